"""``python -m maxdiffusion_svg.train CONFIG [key=value ...]``: fine-tuning Wan 2.1 with SVG through
MaxDiffusion's own ``train_wan`` (see ``plugin.launcher`` and ``plugin.training``)."""

if __name__ == "__main__":
  from maxdiffusion_svg.plugin.launcher import TRAIN, main
  main(entry=TRAIN)
