"""The ``stop-redis`` command: shut the embedded Redis of this home down now.

Imported only when ``stop-redis`` runs or its help is asked (see ``scheduler.cli``).
The embedded Redis also stops by itself once idle (``worker.fleet.embedded_redis``);
this is for a home its user is done with, or before moving it.
"""

from __future__ import annotations

import click

from scheduler.cli.common import load_settings
from scheduler.output import console
from worker.fleet import embedded_redis
from worker.instrument.errors import Refusal


@click.command("stop-redis")
@click.option("--force", is_flag=True, help="Stop it even while clients (workers) are connected.")
def stop_redis(force: bool) -> None:
    """Stop this home's embedded Redis now; its data is kept for its next start.

    Refused while clients such as workers are connected, unless --force.
    """
    settings = load_settings()
    if settings.broker_url:
        raise Refusal(
            "OUROBOROS_BROKER_URL is set, so this home has no embedded Redis to stop; "
            "stop that Redis where it runs"
        )
    socket = settings.redis_socket
    if not embedded_redis.running(settings):
        console.print(f"the embedded Redis at {socket} is not running", highlight=False)
        return
    connected = embedded_redis.clients(settings)
    if connected and not force:
        raise Refusal(
            f"the embedded Redis at {socket} has {connected} connected clients (workers?); "
            "stop them first, or pass --force"
        )
    embedded_redis.stop(settings)
    console.print(
        f"stopped the embedded Redis at {socket}; its data is kept in {socket.parent}",
        highlight=False,
    )
