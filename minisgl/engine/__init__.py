from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine, ForwardOutput

__all__ = ["Engine", "EngineConfig", "ForwardOutput"]
