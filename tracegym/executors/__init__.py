"""Where rollouts run relative to the update (``executor.kind``: local, threads, ray).

Exported here: ``StalenessGate`` (``tracegym.executors.gate``), the pure-Python admission of
rollouts by version lag that every asynchronous executor shares. The executors themselves are
imported from their modules (``tracegym.executors.factory.make_executor``), so importing this
package pulls in neither torch nor Ray.
"""

from tracegym.executors.gate import StalenessGate

__all__ = ["StalenessGate"]
