"""What the plugin expects of MaxDiffusion, checked when the hooks are installed.

The hooks wrap MaxDiffusion functions and the kernel re-enters two private ones. A change
upstream (a renamed parameter, a moved function) would otherwise break them silently or with
a stack trace far from the cause; :func:`check` compares each against what the plugin relies
on and fails at once, naming the function, what was expected, what was found and the
MaxDiffusion commit the plugin is tested with. Nothing here imports MaxDiffusion at import
time: :func:`check` takes the module lookup, so tests can hand it stand-ins.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Iterable, Sequence

TESTED_COMMIT = "7cfb8801d41d"


class MaxDiffusionDrift(RuntimeError):
  """MaxDiffusion differs from what the plugin was written against."""


@dataclasses.dataclass(frozen=True)
class Expected:
  """A function the plugin wraps or calls: its leading parameters (in order) and the ones it
  must accept by name."""

  module: str
  name: str  # attribute path in the module, e.g. "WanModel.__call__"
  why: str
  leading: tuple[str, ...] = ()
  keywords: tuple[str, ...] = ()

  @property
  def where(self) -> str:
    return f"{self.module}.{self.name}"


# The keywords kernel.dense_attention passes to MaxDiffusion's dispatcher.
APPLY_ATTENTION_KEYWORDS = (
    "query", "key", "value", "heads", "dim_head", "split_head_dim", "float32_qk_product",
    "attention_kernel", "flash_min_seq_length", "use_memory_efficient_attention", "scale",
    "dtype", "mesh", "axis_names_q", "axis_names_kv", "flash_block_sizes", "dpa_layer",
    "mask_padding_tokens", "residual_checkpoint_name", "attention_mask", "use_base2_exp",
    "use_experimental_scheduler", "ulysses_shards", "ulysses_attention_chunks", "is_causal")

ATTENTION = "maxdiffusion.models.attention_flax"
WAN_MODEL = "maxdiffusion.models.wan.transformers.transformer_wan"
WAN_PIPELINE = "maxdiffusion.pipelines.wan.wan_pipeline"
UNIPC = "maxdiffusion.schedulers.scheduling_unipc_multistep_flax"
VACE_PIPELINE = "maxdiffusion.pipelines.wan.wan_vace_pipeline_2_1"
VACE_MODEL = "maxdiffusion.models.wan.transformers.transformer_wan_vace"
ANIMATE_PIPELINE = "maxdiffusion.pipelines.wan.wan_pipeline_animate"
ANIMATE_MODEL = "maxdiffusion.models.wan.transformers.transformer_wan_animate"
LTX2_PIPELINE = "maxdiffusion.pipelines.ltx2.ltx2_pipeline"
LTX2_MODEL = "maxdiffusion.models.ltx2.transformer_ltx2"

EXPECTED = (
    Expected(WAN_MODEL, "WanModel.__call__", "the hook reads the latent shape and the timestep",
             leading=("self", "hidden_states", "timestep")),
    Expected(ATTENTION, "NNXAttentionOp.apply_attention",
             "the hook marks the running op (its layer index)", leading=("self",)),
    Expected(WAN_PIPELINE, "create_sharded_logical_transformer",
             "the hook reads the svg keys before weights load and prepares the model",
             leading=("devices_array", "mesh", "rngs", "config", "restored_checkpoint",
                      "subfolder")),
    Expected(VACE_PIPELINE, "create_sharded_logical_transformer",
             "the hook reads the svg keys before Wan VACE loads and prepares it",
             leading=("devices_array", "mesh", "rngs", "config")),
    Expected(VACE_MODEL, "WanVACEModel.__call__",
             "the hook reads the latent shape (references included) and the timestep",
             leading=("self", "hidden_states", "timestep")),
    Expected(ANIMATE_PIPELINE, "create_sharded_animate_transformer",
             "the hook reads the svg keys before Wan Animate loads and prepares it",
             leading=("devices_array", "mesh", "rngs", "config")),
    Expected(ANIMATE_MODEL, "WanAnimateTransformer3DModel.__call__",
             "the hook reads the latent shape (the reference slot included) and the timestep",
             leading=("self", "hidden_states", "timestep")),
    Expected(ANIMATE_PIPELINE, "WanAnimatePipeline.__call__",
             "the hook writes the run's schedule before the pipeline splits its transformer",
             leading=("self",)),
    Expected("maxdiffusion.generate_wan_animate", "run",
             "the hook checks the job before the pipeline loads", leading=("config",)),
    Expected(LTX2_PIPELINE, "create_sharded_logical_transformer",
             "the hook reads the svg keys before LTX-2 loads and prepares it",
             leading=("devices_array", "mesh", "rngs", "config")),
    Expected(LTX2_MODEL, "LTX2VideoTransformer3DModel.__call__",
             "the hook reads the video's latent sizes and the timestep",
             leading=("self", "hidden_states")),
    Expected(LTX2_PIPELINE, "LTX2Pipeline.__call__",
             "the hook marks the running pipeline and logs its run summary", leading=("self",)),
    Expected("maxdiffusion.schedulers.scheduling_flow_match_flax",
             "FlaxFlowMatchScheduler.set_timesteps_ltx2",
             "the hook copies LTX-2's timesteps into its transformer", leading=("self",)),
    Expected("maxdiffusion.generate_ltx2", "run",
             "the hook checks the job before the pipeline loads", leading=("config", "pipeline")),
    Expected(WAN_PIPELINE, "WanPipeline.__call__", "the hook marks the running pipeline",
             leading=("self",)),
    Expected(UNIPC, "FlaxUniPCMultistepScheduler.set_timesteps",
             "the hook copies the run's timesteps into the transformers (and sets Wan "
             "Animate's ahead of its segments)", leading=("self", "state")),
    Expected("maxdiffusion.aot_cache", "install",
             "the hook adds the svg settings to the executable cache key",
             leading=("cache_dir", "meta", "mesh")),
    Expected("maxdiffusion.generate_wan", "run",
             "the hook checks the job before the pipeline loads", leading=("config", "pipeline")),
    Expected("maxdiffusion.generate_wan", "maybe_tune_block_sizes",
             "the hook runs our tile search instead of MaxDiffusion's under attention: svg",
             leading=("config",)),
    Expected("maxdiffusion.generate_ltx2", "maybe_tune_block_sizes",
             "the hook runs our tile search instead of MaxDiffusion's under attention: svg",
             leading=("config",)),
    Expected(ATTENTION, "_apply_attention",
             "dense calls (cross-attention, masks, short sequences) re-enter the dispatcher",
             keywords=APPLY_ATTENTION_KEYWORDS),
    Expected(ATTENTION, "_reshape_heads_to_head_dim",
             "the kernel returns [B, S, H*D] as MaxDiffusion's kernels do", leading=("tensor",)),
    Expected(ATTENTION, "register_kernel", "the svg kernel is registered by name",
             leading=("name",)),
)


def _drift(expected: Expected, wanted: str, found: str) -> MaxDiffusionDrift:
  return MaxDiffusionDrift(
      f"MaxDiffusion drift: {expected.where} {wanted}, found {found}. maxdiffusion_svg uses it "
      f"because {expected.why}; it is tested with MaxDiffusion {TESTED_COMMIT}. Use that "
      f"commit, or a maxdiffusion_svg release made for your MaxDiffusion.")


def _resolve(obj: Any, path: str) -> Any:
  for part in path.split("."):
    obj = getattr(obj, part)
  return obj


def check_one(expected: Expected, lookup: Callable[[str], Any]) -> None:
  """Raises :class:`MaxDiffusionDrift` where ``expected`` does not hold."""
  try:
    fn = _resolve(lookup(expected.module), expected.name)
  except (ImportError, AttributeError) as e:
    raise _drift(expected, "should exist", f"{type(e).__name__}: {e}") from e
  if not callable(fn):
    raise _drift(expected, "should be callable", type(fn).__name__)
  params = inspect.signature(fn).parameters
  names = list(params)
  if expected.leading and names[:len(expected.leading)] != list(expected.leading):
    raise _drift(expected, f"should start with parameters ({', '.join(expected.leading)})",
                 f"({', '.join(names)})")
  takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  missing = [k for k in expected.keywords if k not in params and not takes_any]
  if missing:
    raise _drift(expected, f"should accept {', '.join(missing)}", f"({', '.join(names)})")


def check(lookup: Callable[[str], Any] = importlib.import_module,
          expectations: Iterable[Expected] = EXPECTED) -> None:
  """Checks every expectation (the first mismatch raises)."""
  for expected in expectations:
    check_one(expected, lookup)


def require_attributes(obj: Any, where: str, names: Sequence[str], why: str) -> None:
  """A runtime object has the attributes a hook reads (else :class:`MaxDiffusionDrift`)."""
  missing = [n for n in names if not hasattr(obj, n)]
  if missing:
    raise MaxDiffusionDrift(
        f"MaxDiffusion drift: {where} has no {', '.join(missing)} (maxdiffusion_svg reads "
        f"{', '.join(names)} because {why}); it is tested with MaxDiffusion {TESTED_COMMIT}.")
