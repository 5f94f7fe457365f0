"""A Wan 2.1 14B training step, compiled by libtpu for a TPU slice from any host.

One row per attention kernel (``svg``, and MaxDiffusion's ``flash``, which its Wan training
recipe uses): the model is built as :mod:`maxdiffusion_svg.bench.wan_aot` builds it (MaxDiffusion's
``create_sharded_logical_transformer``, no weight anywhere, every parameter a
``ShapeDtypeStruct`` with its logical-rule ``NamedSharding``) from ``configs/wan_svg_train.yml``
(its ``base_config`` chain merged, ``attention`` replaced per row), on the mesh MaxDiffusion
builds from the config's ``ici_*`` parallelism over a TPU topology's abstract devices
(``v6e:2x4``: fsdp 4 x context 2 with the fsdp recipe).

The step is MaxDiffusion's own: ``--step trainer`` (the default) compiles
``maxdiffusion.trainers.wan_trainer.train_step`` itself, jitted as ``WanTrainer.get_train_step``
jits it (state and data shardings, the state donated), on the ``TrainState`` its
``training_loop`` builds (``nnx.split(transformer, nnx.Param, ...)``, its AdamW from
``max_utils.create_optimizer``) and the batch its data iterator feeds (``global_batch_size_to_load``
videos sharded by ``data_sharding``, the first ``global_batch_size_to_train_on`` trained on):
flow-matching loss on noisy latents, ``nnx.value_and_grad`` over the parameters with the model
merged inside, gradient norms, the optimizer update. ``--step grads`` compiles only the loss
and its gradient (the same loss, written out here from the trainer's ``loss_fn``; no
optimizer state, no update), to tell the optimizer's share from the model's.

MaxDiffusion computes the batch sizes from ``jax.devices()``, which on a compile-only host is
the one CPU: the sizes are computed here for the topology's device count by pyconfig's own rule,
and the trainer sees them through a config view (nothing else of the config changes).

Each row records whether it compiled (else the compiler's error line), per-device bytes from
``memory_analysis()`` (arguments, outputs, aliased, temporaries, and the host-offloaded
temporaries of the remat policy), compile seconds, and the Mosaic kernel calls in the compiled
HLO. ``backward_step_mib`` sets the svg XLA backward's float32 logits per scan step
(``kernels/backward.py``'s ``_STEP_LOGIT_BYTES``) while tracing, to see what the backward's
steps cost. Nothing runs on a device.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence
from unittest import mock

from maxdiffusion_svg.bench import wan_aot
from maxdiffusion_svg.plan.target import MIB

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "wan_svg_train.yml"
KERNELS = ("svg", "flash")
STEPS = ("trainer", "grads")
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code", "host_argument",
                 "host_output", "host_alias", "host_temp")


class _ConfigView:
  """MaxDiffusion's config with some keys answered otherwise (the batch sizes of the slice)."""

  def __init__(self, config: Any, **keys: Any):
    object.__setattr__(self, "_config", config)
    object.__setattr__(self, "_keys", keys)

  def __getattr__(self, name: str) -> Any:
    keys = object.__getattribute__(self, "_keys")
    return keys[name] if name in keys else getattr(object.__getattribute__(self, "_config"), name)

  def get_keys(self) -> dict[str, Any]:
    return {**self._config.get_keys(), **self._keys}


def batch_sizes(per_device_batch_size: float, devices: int) -> tuple[int, int]:
  """``(global_batch_size_to_load, global_batch_size_to_train_on)`` for ``devices`` chips, by
  MaxDiffusion's ``pyconfig`` rule (below one video per device it loads one per device and
  trains on the first ``devices * per_device_batch_size``)."""
  from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
  with mock.patch.object(pyconfig.jax, "devices", return_value=[None] * devices):
    return pyconfig._HyperParameters.calculate_global_batch_sizes(per_device_batch_size)  # pylint: disable=protected-access


@contextlib.contextmanager
def backward_step(mib: float | None) -> Iterator[None]:
  """The svg XLA backward's float32 logits per scan step set to ``mib`` MiB while tracing."""
  if mib is None:
    yield
    return
  from maxdiffusion_svg.kernels import backward  # pylint: disable=import-outside-toplevel
  with mock.patch.object(backward, "_STEP_LOGIT_BYTES", int(mib * MIB)):
    yield


def memory(executable: Any) -> dict[str, int]:
  """Per-device bytes of a compiled executable, device and host (offload) memory."""
  analysis = executable.memory_analysis()
  if analysis is None:
    return {}
  return {name: int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0) for name in MEMORY_FIELDS}


class _Compiled(NamedTuple):
  ok: bool
  seconds: float
  error: str = ""
  detail: str = ""
  executable: Any = None


def _compile(lowered: Any, options: dict[str, str] | None = None) -> _Compiled:
  """``lowered`` compiled; on failure the compiler's error line (:func:`tpu_aot.error_line`) and
  its sentences about memory in full (an HBM out-of-memory names what it needed)."""
  from maxdiffusion_svg.tpu.aot import error_line  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  try:
    executable = lowered.compile(compiler_options=options or {})
  except Exception as err:  # pylint: disable=broad-except
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    memory_lines = [line for line in lines
                    if re.search(r"memory|HBM|hbm|[\d.]+[KMG]\b|exceed", line)][:12]
    return _Compiled(False, time.perf_counter() - start, error_line(text),
                     "\n".join(memory_lines)[:4000])
  return _Compiled(True, time.perf_counter() - start, executable=executable)


def _grads_step(scheduler: Any, config: Any) -> Callable[..., Any]:
  """The trainer's ``loss_fn`` and ``nnx.value_and_grad`` over the parameters, without the
  optimizer: ``(params, graphdef, rest, data, rng) -> (loss, grads)``."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from flax import nnx
  # pylint: enable=import-outside-toplevel

  def step(params, graphdef, rest, data, rng):
    _, new_rng, timestep_rng, dropout_rng = jax.random.split(rng, num=4)
    data = {k: v[: config.global_batch_size_to_train_on] for k, v in data.items()}

    def loss_fn(params):
      model = nnx.merge(graphdef, params, rest)
      latents = data["latents"].astype(config.weights_dtype)
      text = data["encoder_hidden_states"].astype(config.weights_dtype)
      timesteps = scheduler.sample_timesteps(timestep_rng, latents.shape[0])
      noise = jax.random.normal(key=new_rng, shape=latents.shape, dtype=latents.dtype)
      noisy, target, weight = scheduler.apply_flow_match(noise, latents, timesteps)
      pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=text,
                   deterministic=False, rngs=nnx.Rngs(dropout=dropout_rng))
      loss = (target - pred) ** 2
      if not config.disable_training_weights:
        loss = loss * jnp.expand_dims(weight, axis=(1, 2, 3, 4))
      return jnp.mean(loss)

    return nnx.value_and_grad(loss_fn)(params)

  return step


def compile_train_step(kernel: str, config_path: str | pathlib.Path = DEFAULT_CONFIG,
                       topology: str = "v6e:2x4", latent: Sequence[int] = (16, 21, 90, 160),
                       text_len: int = 512, num_layers: int | None = None,
                       step: str = "trainer", per_device_batch_size: float | None = None,
                       backward_step_mib: float | None = None,
                       options: dict[str, str] | None = None,
                       log: Callable[[str], None] = print,
                       overrides: dict[str, Any] | None = None,
                       hlo_dir: str | pathlib.Path | None = None) -> dict[str, Any]:
  """One kernel's row (see :func:`compile_wan_train_steps`)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from flax.linen import partitioning as nn_partitioning
  from jax.sharding import NamedSharding, PartitionSpec
  from maxdiffusion import max_utils
  from maxdiffusion.trainers import base_wan_trainer, wan_trainer

  from maxdiffusion_svg import plugin
  from maxdiffusion_svg.plugin import hooks
  # pylint: enable=import-outside-toplevel
  if step not in STEPS:
    raise ValueError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
  plugin.register()
  keys = dict(overrides or {})
  if per_device_batch_size is not None:
    keys["per_device_batch_size"] = per_device_batch_size
  config = wan_aot.init_config(config_path, kernel, **keys)
  layers = num_layers or wan_aot.WAN_14B["num_layers"]
  mesh_devices = wan_aot.topology_mesh(config, topology)
  mesh = mesh_devices[1]
  load, train = batch_sizes(config.per_device_batch_size, mesh.size)
  if train < 1:
    raise ValueError(f"per_device_batch_size {config.per_device_batch_size} on {mesh.size} "
                     f"devices trains on no video")
  view = _ConfigView(config, global_batch_size_to_load=load,
                     global_batch_size_to_train_on=train)
  row: dict[str, Any] = {
      "kernel": kernel, "step": step, "ok": False, "error": "", "memory": {}, "seconds": None,
      "lower_seconds": None, "mosaic_kernels": None, "mosaic_kernel_names": [],
      "num_layers": layers, "topology": topology, "mesh": dict(mesh.shape),
      "latent": tuple(latent), "text_len": text_len,
      "per_device_batch_size": config.per_device_batch_size, "batch_loaded": load,
      "batch_trained": train, "remat_policy": config.remat_policy,
      "backward_step_mib": backward_step_mib,
      "flash_min_seq_length": config.flash_min_seq_length}
  start = time.perf_counter()
  model = wan_aot.weightless_transformer(config, mesh_devices, layers)
  if kernel == plugin.KERNEL_NAME:
    if not hooks.is_prepared(model):
      raise RuntimeError("the svg transformer was not prepared by the create-transformer hook")
    settings = model.svg_settings
    row["svg"] = settings.summary(settings.svg.target(mesh=mesh))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = wan_aot.abstract_tree(params, mesh), wan_aot.abstract_tree(rest, mesh)
  scheduler, scheduler_state = base_wan_trainer.BaseWanTrainer.create_scheduler(None)
  data_sharding = NamedSharding(mesh, PartitionSpec(*config.data_sharding))
  data = {"latents": jax.ShapeDtypeStruct((load, *latent), jnp.float32, sharding=data_sharding),
          "encoder_hidden_states": jax.ShapeDtypeStruct(
              (load, text_len, wan_aot.WAN_14B["text_dim"]), jnp.float32,
              sharding=data_sharding)}
  rng = jax.eval_shape(lambda: jax.random.key(config.seed))
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules), \
       backward_step(backward_step_mib):
    if step == "trainer":
      lr_schedule = max_utils.create_learning_rate_schedule(
          config.learning_rate, config.learning_rate_schedule_steps,
          config.warmup_steps_fraction, config.max_train_steps)
      tx = max_utils.create_optimizer(config, lr_schedule)
      state = jax.eval_shape(lambda p: base_wan_trainer.TrainState.create(
          apply_fn=graphdef.apply, params=p, tx=tx, graphdef=graphdef, rest_of_state=rest),
                             params)
      state_shardings = nnx.get_named_sharding(state, mesh)
      state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           state, state_shardings)
      scheduler_state = wan_aot.abstract_tree(jax.tree.map(jnp.asarray, scheduler_state), mesh)
      trainer = wan_trainer.WanTrainer.__new__(wan_trainer.WanTrainer)
      trainer.config = view
      pipeline = type("Pipeline", (), {"scheduler": scheduler})()
      data_shardings = trainer.get_data_shardings(mesh)
      jitted = trainer.get_train_step(pipeline, mesh, state_shardings, data_shardings)
      lowered = jitted.lower(state, data, rng, scheduler_state)
    else:
      fn = jax.jit(_grads_step(scheduler, view), static_argnums=(1,))
      lowered = fn.lower(params, graphdef, rest, data, rng)
  row["lower_seconds"] = round(time.perf_counter() - start, 1)
  log(f"  {kernel}: built and lowered in {row['lower_seconds']} s; compiling for {topology}...")
  result = _compile(lowered, options)
  if result.ok:
    row["memory"] = memory(result.executable)
  else:
    row["error_detail"] = result.detail
  return wan_aot.record_compile(row, result, kernel, hlo_dir,
                                f"wan_train_{kernel}_{layers}layers", log)


def compile_wan_train_steps(kernels: Sequence[str] = KERNELS,
                            config_path: str | pathlib.Path = DEFAULT_CONFIG,
                            topology: str = "v6e:2x4", frames: int | None = None,
                            height: int | None = None, width: int | None = None,
                            text_len: int = 512, num_layers: int | None = None,
                            step: str = "trainer", per_device_batch_size: float | None = None,
                            backward_step_mib: float | None = None,
                            options: dict[str, str] | None = None,
                            log: Callable[[str], None] = print,
                            overrides: dict[str, Any] | None = None,
                            hlo_dir: str | pathlib.Path | None = None) -> dict[str, Any]:
  """Wan 2.1 14B's training step compiled for ``topology`` with each attention kernel.

  The video is the config's (``num_frames``, ``height``, ``width``) unless given;
  ``num_layers`` (default 40) reduces depth, the layers still one scanned body;
  ``per_device_batch_size`` overrides the config's (the recipe's 0.25: 2 videos on 8 chips);
  ``backward_step_mib`` applies to svg's rows; ``hlo_dir`` keeps each compiled HLO text. Returns ``{"topology", "latent", ...,
  "kernels": {kernel: row}}``; a row has ``ok, error, memory`` (per-device bytes: ``argument,
  output, alias, temp``, host offload ``host_*``), ``seconds`` (compile), ``lower_seconds``,
  ``mosaic_kernels``, the batch loaded and trained on, the mesh. A compiler failure is a row;
  an error while building or tracing propagates.
  """
  from maxdiffusion_svg.plugin import overlay  # pylint: disable=import-outside-toplevel
  merged, _ = overlay.load_config(config_path)
  video = (frames or int(merged["num_frames"]), height or int(merged["height"]),
           width or int(merged["width"]))
  latent = wan_aot.latent_shape(*video)
  layers = num_layers or wan_aot.WAN_14B["num_layers"]
  result: dict[str, Any] = {
      "topology": topology, "config": str(config_path), "video": video, "latent": latent,
      "text_len": text_len, "num_layers": layers,
      "full_depth": layers == wan_aot.WAN_14B["num_layers"], "step": step,
      "options": dict(options or {}), "overrides": dict(overrides or {}),
      "backward_step_mib": backward_step_mib, "kernels": {}}
  for kernel in kernels:
    log(f"Wan 2.1 14B train step ({step}), attention={kernel}, {layers} layers, latent "
        f"{'x'.join(map(str, latent))}, on {topology}:")
    row = compile_train_step(kernel, config_path, topology, latent, text_len, layers, step,
                             per_device_batch_size,
                             backward_step_mib if kernel == "svg" else None, options, log,
                             {**(overrides or {}), **wan_aot.KERNEL_KEYS.get(kernel, {})},
                             hlo_dir)
    result["kernels"][kernel] = row
    result["mesh"] = row["mesh"]
    result["batch_trained"] = row["batch_trained"]
    result["per_device_batch_size"] = row["per_device_batch_size"]
  return result


def format_wan_train_steps(result: dict[str, Any]) -> str:
  """A markdown table of :func:`compile_wan_train_steps`' result (memory per device, MiB)."""
  latent = "x".join(map(str, result["latent"]))
  mesh = ", ".join(f"{k} {v}" for k, v in result.get("mesh", {}).items())
  depth = (f"{result['num_layers']} layers" + ("" if result.get("full_depth")
                                                else " (reduced from 40)"))
  what = ("MaxDiffusion's train_step (loss, gradients, AdamW update)" if result["step"] == "trainer"
          else "loss and gradients (no optimizer)")
  lines = [f"Wan 2.1 14B training step compiled for {result['topology']} (mesh {mesh}): {what}; "
           f"{depth}, scan; latent {latent}, {result.get('batch_trained', '?')} videos "
           f"(per_device_batch_size {result.get('per_device_batch_size', '?')}), "
           f"{result['text_len']} text tokens; per-device memory from memory_analysis()",
           "",
           "| kernel | compiles | arguments MiB | outputs MiB | aliased MiB | temp MiB "
           "| host temp MiB | compile s | Mosaic kernels | error |",
           "|---|---|---|---|---|---|---|---|---|---|"]

  mib = wan_aot.mib

  for name, row in result["kernels"].items():
    error = row["error"].replace("|", "\\|") if row["error"] else ""
    kernels = "-" if row["mosaic_kernels"] is None else str(row["mosaic_kernels"])
    label = name if row.get("backward_step_mib") is None else (
        f"{name} (backward {row['backward_step_mib']:g} MiB/step)")
    lines.append(f"| {label} | {'yes' if row['ok'] else 'no'} | {mib(row, 'argument')} "
                 f"| {mib(row, 'output')} | {mib(row, 'alias')} | {mib(row, 'temp')} "
                 f"| {mib(row, 'host_temp')} | {row['seconds']} | {kernels} | {error} |")
  rows = result["kernels"]
  if all(k in rows and rows[k]["ok"] for k in ("svg", "flash")):
    svg, flash = rows["svg"]["memory"]["temp"], rows["flash"]["memory"]["temp"]
    lines += ["", f"svg's temporaries are {svg / MIB:,.1f} MiB against flash's "
                  f"{flash / MIB:,.1f} MiB ({'within' if svg <= flash else 'over'} flash's, "
                  f"{(svg - flash) / MIB:+,.1f} MiB)."]
  return "\n".join(lines)
