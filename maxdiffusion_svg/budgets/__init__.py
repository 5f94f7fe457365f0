"""What each call spends and when: ``SvgConfig``, the schedule, per-layer and per-head budgets."""
