"""Cache profiler: replay route traces through the runtime's policies (`mtplx profile`).

    traces.load -> replay.profile / replay.replay_runtime -> stats -> report
"""

from .replay import Result, drive, profile, record_bytes, replay_runtime
from .traces import Trace, load, synthetic, write_route_trace

__all__ = ["Result", "Trace", "drive", "load", "profile", "record_bytes", "replay_runtime",
           "synthetic", "write_route_trace"]
