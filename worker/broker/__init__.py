"""The model broker: the only way an organism reaches a language model.

Owns, per generation, the model socket and its provider-neutral ABI (server), the
capability manifest (server.capabilities), the spending ledger (ledger), the
provider translations (providers), their prices (prices) and their keys
(credentials). The sandbox sees the socket and the manifest; everything else stays
on the trusted side.
"""

from __future__ import annotations

from worker.broker.providers import (
    GenerationContext,
    Provider,
    ProviderReply,
    ProviderUnavailable,
    make_provider,
)
from worker.broker.server import ModelBroker, capabilities

__all__ = [
    "GenerationContext",
    "ModelBroker",
    "Provider",
    "ProviderReply",
    "ProviderUnavailable",
    "capabilities",
    "make_provider",
]
