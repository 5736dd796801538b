"""Where rollouts run relative to the update (``executor.kind``: local, threads, ray).

Exported here: ``StalenessGate`` (``tracegym.rl.executors.gate``), the pure-Python admission of
rollouts by version lag that every asynchronous executor shares. The executors themselves are
imported from their modules (``tracegym.rl.executors.factory.make_executor``), so importing this
package pulls in neither torch nor Ray.
"""

from tracegym.rl.executors.gate import StalenessGate

__all__ = ["StalenessGate"]
