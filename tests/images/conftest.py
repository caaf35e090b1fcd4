"""The kmock cluster of the operator tests, for the operator container to reconcile against."""

from tests.operator.conftest import cluster  # noqa: F401
