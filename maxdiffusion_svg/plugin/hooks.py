"""What MaxDiffusion's kernel call lacks, supplied by a few documented hooks.

A registered attention kernel receives ``(q, k, v, context)`` and nothing about the video.
SVG also needs the token grid, the denoising step, the layer and the Wan 2.2 expert. The
hooks below supply them, each a wrapper around one MaxDiffusion function, installed once
by :func:`installer.install` (MaxDiffusion's files are not modified):

* ``create_sharded_logical_transformer`` (``wan_pipeline``): reads the ``svg_*`` keys of
  the global config (errors before weights load), then :func:`prepare_transformer` the
  model: settings and expert as static attributes, a per-layer index variable on each
  self-attention op, and a variable for the run's timestep schedule.
* ``WanModel.__call__``: the grid from the latent shape and patch size (static ints), and
  the step as a *traced* function of the timestep it receives: the number of schedule
  timesteps above it. The jitted forward is compiled once and reused for every step, the
  warm-up and ``lax.scan`` loops included, so nothing step-dependent is a trace constant.
* ``NNXAttentionOp.apply_attention``: the running op, whose layer index is sliced per
  layer by ``nnx.scan`` (``scan_layers: True``) or set per block (``False``).
* every Wan pipeline's ``__call__`` and the scheduler's ``set_timesteps``: when a pipeline
  sets its timesteps, they are written into its transformers' schedule variables, which
  travel to the jitted forward as data (a fixed-length array: no recompilation). After each
  pipeline call, the run summary (:mod:`run_summary`) is logged.
* ``aot_cache.install``: adds the SVG settings to the compiled-executable cache key.
* ``generate_wan.run``: the job's checks (:mod:`preflight`: run name, processes joined,
  context shards against heads), after ``jax.distributed`` starts and before weights load; a
  Wan VACE config goes on to our VACE main (these two: :mod:`hooks_entry`).
* ``generate_wan.maybe_tune_block_sizes``: with ``enable_tile_search``, our kernel's tiles
  searched on the chip instead of MaxDiffusion's ``flash_block_sizes`` (:mod:`tile_tuning`).
* the same for Wan VACE and Wan Animate (their model calls and factories; what is their own,
  with their generate drivers, in their modules :mod:`wan_vace` and :mod:`wan_animate`) and
  for LTX-2 (its module, :mod:`ltx2`); which family a model is and where its self-attention
  ops sit: :mod:`families`.

Values cross from a hook to the kernel through context variables, set only while the
wrapped call runs (its trace, for jitted code). A model with semantic warm starts also holds
its layers' centroids in mutable arrays (:mod:`semantic_store`), which the kernel reads and writes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from maxdiffusion_svg.budgets.budget import PER_LAYER
from maxdiffusion_svg.budgets.per_head import check_head_shape
from maxdiffusion_svg.budgets.per_layer import check_layer_count
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import contract, families, run_summary, semantic_store
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import experts_of

# The schedule variable's fixed length: Wan's schedulers have 1000 training timesteps.
MAX_STEPS = 1000
EXPERT_OF_SUBFOLDER = {"transformer": "high_noise", "transformer_2": "low_noise"}
_PIPELINE_TRANSFORMERS = ("transformer", "high_noise_transformer", "low_noise_transformer")


class SvgTimesteps(nnx.Variable):
  """The run's timestep schedule, padded with -1 to ``MAX_STEPS`` entries."""


class SvgExpertTag(nnx.Variable):
  """A Wan 2.2 expert's mark in the model's state, by its shape.

  The expert is a static attribute (it picks the density, baked into the tile tables), and
  MaxDiffusion's AOT cache keys an executable by its inputs' paths, shapes and dtypes only: two
  experts of one architecture would share the first one's executable. The tag's shape makes
  their inputs, hence their cache keys, differ."""


EXPERT_TAG_SIZE = {"high_noise": 1, "low_noise": 2}


@dataclasses.dataclass(frozen=True)
class ModelCall:
  """What a ``WanModel`` call tells the kernels it runs."""

  model: str  # class name, for error messages
  grid: VideoGrid
  settings: PluginSettings | None  # None: the model was not prepared for svg
  expert: str | None
  step: jax.Array | None  # traced int32; None when no schedule was set
  count_calls: bool = False  # report each self-attention call to run_summary
  traced: Any = None  # the model's run_summary.Traced, where it counts its calls
  # (centroids, ready) refs of a model holding a semantic store, in a denoising run
  semantic_store: tuple[Any, Any] | None = None


_MODEL_CALL: contextvars.ContextVar[ModelCall | None] = contextvars.ContextVar(
    "svg_model_call", default=None)
ATTENTION_OP: contextvars.ContextVar[Any] = contextvars.ContextVar("svg_attention_op",
                                                                    default=None)
_PIPELINE: contextvars.ContextVar[Any] = contextvars.ContextVar("svg_pipeline", default=None)


def current_model_call() -> ModelCall | None:
  return _MODEL_CALL.get()


@contextlib.contextmanager
def model_call(call: ModelCall) -> Iterator[None]:
  """Makes ``call`` what the kernels see while the block runs (the ``WanModel`` hook's job)."""
  token = _MODEL_CALL.set(call)
  try:
    yield
  finally:
    _MODEL_CALL.reset(token)


def current_attention_op() -> Any:
  return ATTENTION_OP.get()


def layer_index(op: Any) -> jax.Array | None:
  """The op's layer index as a traced scalar, if the model was prepared."""
  var = getattr(op, "svg_layer", None)
  return None if var is None else var[...]


# ---------------------------------------------------------------- preparing a transformer


def prepare_transformer(model: Any, settings: PluginSettings, expert: str | None = None,
                        mesh: Any = None, warm_start: bool = True) -> Any:
  """Attaches what the ``svg`` kernel needs to a ``WanModel`` or an LTX-2 transformer (in
  place; returns it).

  Done by the hooks for every transformer a Wan or LTX-2 pipeline loads; call it yourself for
  one built another way. ``expert``: ``high_noise``/``low_noise`` for Wan 2.2.
  With semantic among the layouts, ``svg_semantic_warm_iterations`` above 0 and
  ``warm_start``, the model also holds its semantic
  centroids (a warm start across denoising steps; each Wan 2.2 expert its own), replicated over
  ``mesh`` if given.
  """
  if not isinstance(settings, PluginSettings):
    raise ValueError(f"settings must be PluginSettings, got {type(settings).__name__}")
  budget = settings.svg.budget(expert)  # validates the expert
  ops = list(families.self_attention_ops(model))  # checks the model's layout before changing it
  for what in PER_LAYER:
    check_layer_count(budget.per_layer(what), model.num_layers, budget.key(what))
  if budget.head_densities is not None and ops:
    check_head_shape(budget.head_densities, model.num_layers, int(ops[0][0].heads),
                     budget.key("head"))
  model.svg_settings = settings
  model.svg_expert = expert
  model.svg_video_model = families.family(model)  # its pixel-to-grid map, what runs dense by design
  for op, kind in families.dense_by_design_ops(model):
    op.svg_dense_by_design = kind  # static: the kernel runs it dense and counts it as `kind`
  for op, layer in ops:
    index = jnp.arange(model.num_layers, dtype=jnp.int32) if layer is None else jnp.int32(layer)
    # A plain array leaf (``[num_layers]`` under ``scan_layers``, sliced per layer by
    # ``nnx.scan``), not a Variable: MaxDiffusion's trainer closes over the model's non-Param
    # state inside ``nnx.value_and_grad``, and ``nnx.scan`` refuses a Variable of another trace.
    op.svg_layer = nnx.data(index) if isinstance(op, nnx.Module) else index
  model.svg_timesteps = SvgTimesteps(jnp.full((MAX_STEPS,), -1.0, jnp.float32))
  model.svg_schedule_set = False
  # Why the run summary does not count this model's calls ("": it does).
  model.svg_uncounted = (run_summary.host_callbacks_missing() if settings.run_summary
                         else "svg_run_summary: false")
  model.svg_traced = run_summary.Traced()
  if expert is not None:
    model.svg_expert_tag = SvgExpertTag(jnp.zeros((EXPERT_TAG_SIZE[expert],), jnp.int8))
  if warm_start:
    semantic_store.attach(model, settings, mesh)
  return model


def set_denoising_schedule(model: Any, timesteps: Any) -> None:
  """Writes a run's decreasing timesteps into a prepared model (the pipelines do this).

  The kernel's step is then the number of these timesteps above the one the model is
  called with: step ``i`` for ``timesteps[i]``, whatever ran before.
  """
  timesteps = jnp.asarray(timesteps, jnp.float32).reshape(-1)
  if timesteps.size > MAX_STEPS:
    raise ValueError(f"at most {MAX_STEPS} denoising steps are supported, got {timesteps.size}")
  padded = jnp.full((MAX_STEPS,), -1.0, jnp.float32).at[:timesteps.size].set(timesteps)
  model.svg_timesteps[...] = padded
  model.svg_schedule_set = True  # static: set before the first compile, unchanged after
  semantic_store.reset(model)  # a new run: its first semantic call clusters cold


def is_prepared(model: Any) -> bool:
  return getattr(model, "svg_settings", None) is not None


def prepared_transformers(pipeline: Any) -> list[Any]:
  """The pipeline's transformers prepared for svg (one, or Wan 2.2's two experts)."""
  return [m for m in (getattr(pipeline, n, None) for n in _PIPELINE_TRANSFORMERS)
          if m is not None and is_prepared(m)]


def counts_calls(model: Any) -> bool:
  """Whether a prepared model's self-attention calls report to the run summary."""
  return is_prepared(model) and not model.svg_uncounted


# ------------------------------------------------------------------------------ wrappers


def call_of(model: Any, grid: VideoGrid, timestep: Any) -> ModelCall:
  """What a transformer call at ``timestep`` on ``grid`` tells its kernels: the step as a
  traced count of the run's schedule timesteps above ``timestep``."""
  step = None
  if is_prepared(model) and model.svg_schedule_set:
    # TI2V gives per-token timesteps (0 on the first frame): the step's is the largest.
    t = jnp.max(jnp.asarray(timestep, jnp.float32))
    step = jnp.sum(model.svg_timesteps[...] > t).astype(jnp.int32)
  return ModelCall(type(model).__name__, grid, getattr(model, "svg_settings", None),
                   getattr(model, "svg_expert", None), step, counts_calls(model),
                   getattr(model, "svg_traced", None),
                   # centroids carry over steps of a denoising run only (a step is known)
                   semantic_store.refs(model) if step is not None else None)


def model_call_hook(original: Callable[..., Any]) -> Callable[..., Any]:

  @functools.wraps(original)
  def wrapper(self, hidden_states, timestep, *args, **kwargs):
    _, _, frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    grid = VideoGrid(frames // p_t, height // p_h, width // p_w)
    with model_call(call_of(self, grid, timestep)):
      return original(self, hidden_states, timestep, *args, **kwargs)

  return wrapper


_Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def binding_self(var: contextvars.ContextVar[Any]) -> _Wrapper:
  """Wraps a method so that ``var`` holds its ``self`` while it runs."""

  def make(original: Callable[..., Any]) -> Callable[..., Any]:

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
      token = var.set(self)
      try:
        return original(self, *args, **kwargs)
      finally:
        var.reset(token)

    return wrapper

  return make


def pipeline_call_hook(original: Callable[..., Any]) -> Callable[..., Any]:
  """Binds the pipeline for the scheduler hook, and logs the run summary after each call."""
  bound = binding_self(_PIPELINE)(original)

  @functools.wraps(original)
  def wrapper(self, *args, **kwargs):
    run_summary.reset()
    outputs = bound(self, *args, **kwargs)
    models = prepared_transformers(self)
    line = run_summary.after_call(models, getattr(self, "mesh", None), outputs, kwargs,
                                  original, counted=bool(models) and counts_calls(models[0]))
    if line:
      from maxdiffusion import max_logging  # pylint: disable=import-outside-toplevel
      max_logging.log(f"maxdiffusion_svg: {line}")
    return outputs

  return wrapper


def create_transformer_hook(original: Callable[..., Any]) -> Callable[..., Any]:
  signature = inspect.signature(original)  # each factory's own default subfolder

  @functools.wraps(original)
  def wrapper(devices_array, mesh, rngs, config, *args, **kwargs):
    bound = signature.bind(devices_array, mesh, rngs, config, *args, **kwargs)
    bound.apply_defaults()
    subfolder = bound.arguments.get("subfolder") or ""
    settings = None
    if config.attention == KERNEL_NAME:
      settings = PluginSettings.from_mapping(config.get_keys())  # fails before weights load
      settings.compensation_text(settings.svg.target(mesh=mesh))  # blocks vs the mesh's key tile
    model = original(devices_array, mesh, rngs, config, *args, **kwargs)
    if settings is not None:
      # Wan 2.2's two experts, one rule with the pre-flight's (Animate has one transformer)
      expert = (EXPERT_OF_SUBFOLDER.get(subfolder)
                if experts_of(config.get_keys()) != (None,) else None)
      aot = bool(getattr(config, "aot_cache_dir", ""))
      prepare_transformer(model, settings, expert, mesh, warm_start=not aot)
      if settings.run_summary and aot:
        # MaxDiffusion's AOT cache cannot serialise callbacks.
        model.svg_uncounted = "aot_cache_dir is set: its executables cannot hold host callbacks"
      from maxdiffusion import max_logging  # pylint: disable=import-outside-toplevel
      line = settings.summary(settings.svg.target(mesh=mesh), _ring(config, mesh))
      line += f"; dense by design: {model.svg_video_model.dense_by_design}"
      if aot and settings.svg.semantic is not None and settings.svg.semantic_warm_iterations:
        line += f"; semantic {semantic_store.NO_WARM_START_WITH_AOT}"
      max_logging.log(f"maxdiffusion_svg: {subfolder or 'transformer'}"
                      f"{f' ({expert} expert)' if expert else ''}: {line}")
      empty = settings.empty_window(config.get_keys().get("num_inference_steps"), model.num_layers)
      if empty:  # the same warning as `tiles --config`
        max_logging.log(f"maxdiffusion_svg: warning: {empty}")
    return model

  return wrapper


def _ring(config: Any, mesh: Any) -> tuple[int, int]:
  """``(ulysses shards, ring shards)`` of self-attention on ``mesh``, for the settings line;
  (0, 1) where there is no ring or the split is invalid (the kernel's check names that)."""
  from maxdiffusion_svg.parallel.ring_plan import asks_for_ring  # pylint: disable=import-outside-toplevel
  if mesh is None:
    return 0, 1
  ulysses, context = config.get_keys().get("ulysses_shards", -1), dict(mesh.shape).get("context", 1)
  if not asks_for_ring(ulysses, context) or not isinstance(ulysses, int) or context % ulysses:
    return 0, 1
  return ulysses, context // ulysses


def set_timesteps_hook(original: Callable[..., Any]) -> Callable[..., Any]:

  @functools.wraps(original)
  def wrapper(self, *args, **kwargs):
    state = original(self, *args, **kwargs)
    pipeline = _PIPELINE.get()
    if pipeline is not None:
      contract.require_attributes(state, f"{type(self).__name__}.set_timesteps()'s state",
                                  ("timesteps",), "the svg step is counted from the schedule")
      for model in prepared_transformers(pipeline):
        set_denoising_schedule(model, state.timesteps)
      run_summary.on_schedule()
    return state

  return wrapper


def wrap_once(owner: Any, name: str, make: _Wrapper) -> None:
  """Replaces ``owner.name`` with ``make(original)`` once (re-installing is a no-op)."""
  original = getattr(owner, name)
  if getattr(original, "_svg_hook", False):
    return
  wrapped = make(original)
  wrapped._svg_hook = True  # pylint: disable=protected-access
  setattr(owner, name, wrapped)
