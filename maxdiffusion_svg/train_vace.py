"""``python -m maxdiffusion_svg.train_vace CONFIG [key=value ...]``: fine-tuning Wan VACE with SVG
through MaxDiffusion's own ``train_wan_vace`` (see ``plugin.launcher`` and ``plugin.training``)."""

if __name__ == "__main__":
  from maxdiffusion_svg.plugin.launcher import TRAIN_VACE, main
  main(entry=TRAIN_VACE)
