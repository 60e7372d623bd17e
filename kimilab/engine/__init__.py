"""A continuous-batching serving engine on the hybrid cache (deterministic simulated time).

Step times are :class:`kimilab.costs.StepTimer`'s: one forward pass per step on the engine's deployment.

* ``memory``    InstanceMemory: one page pool for running requests and the prefix cache, tenant quotas
* ``fairness``  FifoQueue and FairQueue (virtual token counters, after VTC)
* ``live``      Live (a request being served) and Finished (what it measured)
* ``gaps``      GapHistogram and GapLog: the time between tokens, token by token, in bounded memory
* ``engine``    Engine: chunked prefill, admission, preemption by recompute, fast-forwarded decode
* ``speculation`` Speculation: k drafts verified in every decode step, acceptance swept, costs counted
* ``tensor``    TensorExecutor: the same loop on the reduced model's real tensors (== Model.generate alone)
"""

from kimilab.engine.engine import Engine, prompt_of
from kimilab.engine.fairness import FairQueue, FifoQueue
from kimilab.engine.gaps import GapHistogram, GapLog
from kimilab.engine.live import Finished, Live
from kimilab.engine.memory import InstanceMemory
from kimilab.engine.speculation import Speculation
from kimilab.engine.tensor import Executor, TensorExecutor, serve

__all__ = ["Engine", "prompt_of", "FairQueue", "FifoQueue", "Finished", "Live", "InstanceMemory", "Speculation",
           "Executor", "TensorExecutor", "serve", "GapHistogram", "GapLog"]
