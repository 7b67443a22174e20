from minisgl.distributed.comm import all_gather, all_reduce
from minisgl.distributed.info import DistributedInfo, get_tp_info, set_tp_info

__all__ = ["DistributedInfo", "all_gather", "all_reduce", "get_tp_info", "set_tp_info"]
