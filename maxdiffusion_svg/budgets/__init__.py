"""What each call spends and when: ``SvgConfig`` and its ``svg_*`` keys, the denoising
schedule (dense warm-up steps and layers), per-layer and per-head budgets."""
