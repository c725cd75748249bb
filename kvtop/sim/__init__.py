"""The simulated vLLM: one engine model (engine.py, profiles.py) shared by ``kvtop sim``'s HTTP
server (server.py) and the offline simulator. See docs/simulator.md."""

from kvtop.sim.engine import (Engine, EngineRejected, EngineRequest, ExceedsKVCapacity,
                              FinishedRequest, RequestTooLong, StepResult, WaitingView)
from kvtop.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile, get_profile

__all__ = ["Engine", "EngineRejected", "EngineRequest", "ExceedsKVCapacity", "FinishedRequest",
           "RequestTooLong", "StepResult", "WaitingView", "DEFAULT_PROFILE", "PROFILES", "Profile",
           "get_profile"]
