"""Layer-pipelined fetch, device cache, compression controller and metrics (DTP)."""
from tierkv.pipeline.controller import CompressionController
from tierkv.pipeline.device_cache import DeviceCache
from tierkv.pipeline.fetcher import Pipeline, PipelineClosedError, StepHandle
from tierkv.pipeline.groupfetch import FetchError
from tierkv.pipeline.metrics import Metrics
from tierkv.pipeline.plan import FetchPlan, GroupFetch
from tierkv.pipeline.throttle import ThrottledDisk

__all__ = ["CompressionController", "DeviceCache", "FetchError", "FetchPlan", "GroupFetch",
           "Metrics", "Pipeline", "PipelineClosedError", "StepHandle", "ThrottledDisk"]
