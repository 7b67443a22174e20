from minisgl.message.backend import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from minisgl.message.tokenizer import DetokenizeMsg

__all__ = ["AbortBackendMsg", "BaseBackendMsg", "BatchBackendMsg", "DetokenizeMsg", "ExitMsg", "UserMsg"]
