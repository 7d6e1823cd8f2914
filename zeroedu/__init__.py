"""zeroedu: DeepSpeed ZeRO stages 0-3, offload and ZeRO++, small enough to read, measured as it runs."""

__version__ = "0.1.0"

from zeroedu.config import Config, ConfigError, load_config  # noqa: E402
from zeroedu.engine import initialize  # noqa: E402
from zeroedu.launch import launch  # noqa: E402

__all__ = ["Config", "ConfigError", "initialize", "launch", "load_config", "__version__"]
