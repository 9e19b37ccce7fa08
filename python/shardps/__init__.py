"""ShardPS worker client for Python (docs/python.md).

    import shardps
    c = shardps.Client("10.0.0.1:7070", cluster_token="secret", transport="tcp")
    c.register("w", w, gw)      # numpy float32 / torch.float32, contiguous: registered, not copied
    c.start()                   # rank 0's weights become everyone's (pulled into w)
    ... c.step() ...            # push gw, clock, pull into w

shardps.torch.DistributedOptimizer wraps a PyTorch model; shardps.launch.LocalCluster starts a
coordinator and servers on this host; `python -m shardps.run -- TRAINER...` starts a cluster and
N copies of any trainer, which find it through the environment (Client() needs no arguments).
"""
from ._shardps import Client, Error, built_with_cuda, row_init  # noqa: F401
from ._build_info import VERSION as __version__  # noqa: F401

__all__ = ["Client", "Error", "row_init", "__version__"]
