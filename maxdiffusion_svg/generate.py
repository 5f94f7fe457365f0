"""``python -m maxdiffusion_svg.generate CONFIG [key=value ...]``: see ``plugin.launcher``."""

if __name__ == "__main__":
  from maxdiffusion_svg.plugin.launcher import main
  main()
