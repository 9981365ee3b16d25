"""dagster-k8s, when the ``kvbatch[k8s]`` extra is installed: the one place that imports it.

The Kubernetes pieces (the ``k8s_job_executor`` that runs each step as a Job, ``PipesK8sClient``
that starts a decode pod) come from dagster-k8s, which must match dagster's version exactly, so it
is an optional extra, imported only where a deployment asks for Kubernetes. Asked for without the
extra, the error says which setting asked and what to install.
"""

from __future__ import annotations

from types import ModuleType

K8S_EXTRA = "kvbatch[k8s]"


class MissingK8sExtra(RuntimeError):
    """Kubernetes was asked for, but dagster-k8s (the ``kvbatch[k8s]`` extra) is not installed."""


def require_dagster_k8s(what: str) -> ModuleType:
    """The ``dagster_k8s`` module, or :class:`MissingK8sExtra` naming ``what`` asked for it and the extra."""
    try:
        import dagster_k8s
    except ImportError as e:
        import dagster

        raise MissingK8sExtra(
            f"{what} needs dagster-k8s, the {K8S_EXTRA} extra: pip install '{K8S_EXTRA}' (it pins the "
            f"dagster-k8s release matching dagster {dagster.__version__})") from e
    return dagster_k8s
