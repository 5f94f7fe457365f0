"""The plugin's settings: ``SvgConfig`` plus the keys only the MaxDiffusion kernel reads.

Parsed from MaxDiffusion's flat global config when a transformer is built, so an invalid
or unknown ``svg_*`` key fails before weights load or anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import enum

from maxdiffusion_svg.budgets.config import EXPERTS, SvgConfig
from maxdiffusion_svg.budgets.config_keys import DEFAULT_PRESET, KEYS, UNSET_BY
from maxdiffusion_svg.budgets.per_layer import layer_ranges
from maxdiffusion_svg.kernels.api import resolve_backend
from maxdiffusion_svg.kernels.vmem_model import libtpu_note
from maxdiffusion_svg.plan.target import TPU_BACKENDS, Target
from maxdiffusion_svg.plugin.calibration_record import CHECK_KEY, RECORD_KEY, measured_on
from maxdiffusion_svg.routing.layouts import ring_note

SUPPORTED_MODELS = ("Wan 2.1 / 2.2 WanModel (T2V, I2V), Wan VACE, Wan Animate and LTX-2 / LTX-2.3 "
                    "transformers built by a MaxDiffusion pipeline, or prepared with "
                    "maxdiffusion_svg.plugin.prepare_transformer")
KERNEL_NAME = "svg"
# svg_* keys the kernel reads itself, and calibrate's record that the run checks
# (calibration_record; SvgConfig reads the rest).
PLUGIN_KEYS = ("svg_dense_kernel", "svg_min_seq_length", "svg_run_summary", RECORD_KEY,
               CHECK_KEY)
DEFAULT_MIN_SEQ_LENGTH = 4096


@dataclasses.dataclass(frozen=True)
class PluginSettings:
  """What the ``svg`` kernel needs besides the attention itself.

  ``dense_kernel``: the MaxDiffusion kernel that runs cross-attention, masked calls and
  short sequences (``None``: ``flash`` on TPU, ``dot_product`` elsewhere).
  ``min_seq_length``: self-attention shorter than this runs dense (SVG's masks need
  several frames of tokens to skip anything).
  ``run_summary``: count each self-attention call and its temporal heads for the end-of-run
  log line (a host callback per call and device); off, the line counts from the schedule.
  ``calibrated_on``, ``calibration_check``: ``calibrate``'s record of what its budgets were
  measured on, as sorted ``(key, value)`` pairs, and whether the run is checked against it
  (:mod:`calibration_record`).
  """

  svg: SvgConfig = SvgConfig()
  dense_kernel: str | None = None
  min_seq_length: int = DEFAULT_MIN_SEQ_LENGTH
  preset: str = DEFAULT_PRESET  # the svg_schedule the keys started from (for the log)
  run_summary: bool = True
  calibrated_on: tuple[tuple[str, Any], ...] = ()
  calibration_check: bool = True

  def __post_init__(self):
    if self.dense_kernel is not None and (not isinstance(self.dense_kernel, str)
                                          or self.dense_kernel == KERNEL_NAME):
      raise ValueError(f"svg_dense_kernel must name a dense MaxDiffusion attention kernel "
                       f"(e.g. flash, dot_product), got {self.dense_kernel!r}")
    value = self.min_seq_length
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"svg_min_seq_length must be an integer >= 0, got {value!r}")
    if not isinstance(self.run_summary, bool):
      raise ValueError(f"svg_run_summary must be true or false, got {self.run_summary!r}")
    if not isinstance(self.calibration_check, bool):
      raise ValueError(f"{CHECK_KEY} must be true or false, got {self.calibration_check!r}")

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, Any]) -> "PluginSettings":
    """From a flat config (MaxDiffusion's ``config.get_keys()``); errors name the key."""
    dense = mapping.get("svg_dense_kernel")
    return cls(svg=SvgConfig.from_mapping(mapping, extra_keys=PLUGIN_KEYS),
               dense_kernel=dense or None,
               min_seq_length=mapping.get("svg_min_seq_length", DEFAULT_MIN_SEQ_LENGTH),
               preset=mapping.get("svg_schedule", DEFAULT_PRESET),
               run_summary=mapping.get("svg_run_summary", True),
               calibrated_on=measured_on(mapping),
               calibration_check=mapping.get(CHECK_KEY, True))

  def summary(self, target: Target | None = None, ring: tuple[int, int] = (0, 1)) -> str:
    """One line for the run's log: what will be sparse, where, and how (on ``target``, the
    hardware of the model's mesh; without it, the settings as given; ``ring``: ``(ulysses
    shards, ring shards)`` of the mesh, which may leave semantic out)."""
    svg = self.svg
    densities = f"density {svg.density}"
    if svg.high_noise_density is not None or svg.low_noise_density is not None:
      densities += (f" (high-noise {svg.density_for('high_noise')}, "
                    f"low-noise {svg.density_for('low_noise')})")
    for expert in (None, "high_noise", "low_noise"):
      budget = svg.budget(expert)
      per_layer = budget.layer_densities
      if per_layer is not None and (expert is None or "densities" in budget.own):
        who = f"{expert.replace('_', '-')} " if expert else ""
        densities += f", {who}per layer {layer_ranges(per_layer)}"
      per_head = budget.head_densities
      if per_head is not None and (expert is None or "head" in budget.own):
        who = f"{expert.replace('_', '-')} " if expert else ""
        flat = [d for row in per_head for d in row]
        densities += (f", {who}per head (svg_head_densities: {len(per_head[0])} heads x "
                      f"{'every layer' if len(per_head) == 1 else f'{len(per_head)} layers'}, "
                      f"{min(flat):g} to {max(flat):g}, mean {sum(flat) / len(flat):.3g})")
    steps, layers = svg.schedule.active_steps, svg.schedule.active_layers
    if target is None:
      tiles = "default" if svg.block_q is None and svg.block_kv is None else (
          f"{svg.block_q or 'default'}x{svg.block_kv or 'default'}")
      backend, dense, where = svg.backend, self.dense_kernel or "flash on TPU, dot_product elsewhere", ""
    else:
      t = svg.tiles(target)
      tiles = f"{t.block_q}x{t.block_kv}"
      backend = resolve_backend(svg.backend, target)
      if backend in TPU_BACKENDS:
        tiles += f" (kv step {t.block_kv_compute})"
      dense, where = self.resolved_dense_kernel(target.platform), f" on {target.describe()}"
      if backend == "splash" and (note := libtpu_note()):
        where += f" ({note})"
    compensation = self.compensation_text(target, None if target is None else backend)
    return (f"SVG attention: preset {self.preset}, {densities}, sparse steps "
            f"[{steps.start}, {steps.end if steps.end is not None else 'end'}) and layers "
            f"[{layers.start}, {layers.end if layers.end is not None else 'end'}), tiles "
            f"{svg.tile_mode.value} {tiles}, backend {backend}{where}, {compensation}, "
            f"{self.layouts_text(ring)}{self.leading_frames_text()}, dense kernel "
            f"{dense} (MaxDiffusion runs it as dot_product below flash_min_seq_length), "
            f"dense below {self.min_seq_length} tokens")

  def leading_frames_text(self) -> str:
    """Where the sink or the dense rows differ from the default (the first frame a sink, its
    queries sparse), for the log line: ``svg_include_sink``, ``svg_sink_frames``,
    ``svg_dense_frames``."""
    svg, text = self.svg, ""
    if not svg.include_sink:
      text += ", no sink (svg_include_sink)"
    elif svg.sink_frames > 1:
      text += f", the first {svg.sink_frames} frames a sink (svg_sink_frames)"
    n = svg.dense_frames
    frames = "frame's" if n == 1 else f"{n} frames'"
    return text + (f", the first {frames} queries dense (svg_dense_frames)" if n else "")

  def layouts_text(self, ring: tuple[int, int] = (0, 1)) -> str:
    """The layouts the router chooses among, for the log lines (``ring``: see :meth:`summary`)."""
    text = "layouts " + ", ".join(self.svg.layouts)
    if self.svg.semantic is not None:
      warm = self.svg.semantic_warm_iterations
      text += (f" ({self.svg.semantic_clusters} clusters, k-means {self.svg.semantic_iterations}"
               + (f" iterations cold, {warm} warm from the previous step's centroids)" if warm
                  else " iterations every step)"))
    if note := ring_note(self.svg.layouts, *ring):
      text += f" ({note})"
    return text

  def compensation_text(self, target: Target | None = None, backend: str | None = None) -> str:
    """The compensation for the log lines; on ``target`` its block count is checked against
    the executor's key tile there (the refusal names ``svg_compensation_blocks``)."""
    if not self.svg.compensates:
      return "compensation off"
    blocks = (self.svg.compensation_blocks if target is None
              else self.svg.any_compensation_for(target, backend))
    per_layer = [f"{f'{e} ' if e else ''}{layer_ranges(c)}" for e in (None, *EXPERTS)
                 if (c := self.svg.budget(e).layer_compensation) is not None
                 and (e is None or "compensation" in self.svg.budget(e).own)]
    where = f" (per layer: {'; '.join(per_layer)})" if per_layer else ""
    return f"compensation {blocks} centroids per key tile{where}"

  def is_short(self, tokens: int) -> bool:
    """Self-attention this short runs dense (the kernel's ``short`` calls)."""
    return tokens < self.min_seq_length

  def empty_window(self, steps: int | None, layers: int | None) -> str | None:
    """Why no self-attention call of a run of ``steps`` steps through ``layers`` layers would
    run sparse, or None. Not an error: the run works, dense, so the run's log and
    ``tiles --config`` both warn with this text."""
    schedule = self.svg.schedule
    for key, interval, total, what in (
        ("svg_active_steps", schedule.active_steps, steps, "the run's {} steps "
                                                            "(num_inference_steps)"),
        ("svg_active_layers", schedule.active_layers, layers, "the transformer's {} layers")):
      if total is not None and interval.count(total) == 0:
        end = interval.end if interval.end is not None else "end"
        return (f"no self-attention call runs sparse: {key} [{interval.start}, {end}) holds "
                f"none of {what.format(total)}; give {key} a start below {total}")
    return None

  def resolved_dense_kernel(self, platform: str) -> str:
    if self.dense_kernel is not None:
      return self.dense_kernel
    return "flash" if platform == "tpu" else "dot_product"


def config_defaults() -> dict[str, Any]:
  """Every ``svg_*`` key with a value that means "the default", for a config to hold.

  MaxDiffusion overrides from the command line only keys its YAML holds (and never a null),
  so the launcher and the patched ``pyconfig`` (entry point group
  ``maxdiffusion.config_defaults``) put these under every config: ``svg_density=0.3`` then
  works whatever the config sets. Values equal the settings of an empty config.
  """
  svg = SvgConfig()
  values: dict[str, Any] = {"svg_schedule": DEFAULT_PRESET, **UNSET_BY}
  for key, field in KEYS.items():
    if key not in values:
      value = getattr(svg, field)
      if isinstance(value, tuple):  # text, so a command line's [a, b] arrives as text to read
        value = f"[{', '.join(value)}]"
      values[key] = 0 if value is None else value.value if isinstance(value, enum.Enum) else value
  return {**values, "svg_dense_kernel": "", "svg_min_seq_length": DEFAULT_MIN_SEQ_LENGTH,
          "svg_run_summary": True, RECORD_KEY: {}, CHECK_KEY: True}
