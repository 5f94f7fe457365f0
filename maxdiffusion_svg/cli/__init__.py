"""``python -m maxdiffusion_svg``: the command-line tools and their reports and plots."""
