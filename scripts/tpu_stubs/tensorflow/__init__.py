"""A stand-in for TensorFlow on a borrowed TPU machine (scripts/tpu_env.sh).

MaxDiffusion's ``maxdiffusion_utils`` imports TensorFlow at module level for its data loaders,
which neither a step nor a generation from random weights or a tiny checkpoint reaches; the
machine's index holds ``tensorflow-cpu`` (about 1 GB installed) only to satisfy that import.
Any use of this module raises, naming the reason.
"""


class _Meta(type):
  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return _Meta(name, (_StandIn,), {})


class _StandIn(metaclass=_Meta):
  def __init__(self, *args, **kwargs):
    raise RuntimeError("tensorflow is a stand-in here (scripts/tpu_stubs): install "
                       "tensorflow-cpu to use MaxDiffusion's data loaders")


def __getattr__(name):
  if name.startswith("__"):
    raise AttributeError(name)
  return _Meta(name, (_StandIn,), {})
