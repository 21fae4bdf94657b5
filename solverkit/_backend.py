"""Which platform a solve being traced will run on."""

import jax


def platform() -> str:
    """The platform (`"cpu"`, `"gpu"`, `"tpu"`) of the device a program traced now
    runs on, as far as tracing can tell: `jax.default_device`'s where one is set
    (a solve on the host CPU of a TPU machine must not be lowered as a TPU kernel),
    else JAX's default backend."""
    device = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
    if device is None:
        return jax.default_backend()
    if isinstance(device, str):
        return device
    return device.platform
