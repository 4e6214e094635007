"""JAX options that JAX's test files read from `jax._src.config` and the
installed JAX may not define there: jax 0.12 dropped
`jax_pallas_use_mosaic_gpu`, which dsl still defines (dsl.core.config)."""
from dsl.core import config as dsl_config
from dsl.core.jax_internals import config as jax_config

# The attribute of `jax._src.config` -> dsl's option of that name.
OPTIONS = {
    "jax_pallas_use_mosaic_gpu": dsl_config.use_mosaic_gpu_option,
}


def install() -> None:
  """Gives `jax._src.config` each option of OPTIONS it lacks."""
  for name, option in OPTIONS.items():
    if not hasattr(jax_config, name):
      setattr(jax_config, name, option)
