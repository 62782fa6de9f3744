"""How a shard's peers are served: a thread each, or one thread a round at a time (sync); and
Sandblaster's coordinator, from a thread of its own.

Each loop receives a peer's request into its link (`ShardServer.link`), has the server take it
in (`take`: header checks, the push and its chunks) and answer it (`answer`), and drops the
peer's replica when its connection fails (`drop`). The loops own no state of the shard.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from netpart.errors import ProtocolError
from netpart.ps.commands import serve_commands
from netpart.ps.protocol import TAG_HEADER, Kind

__all__ = ["serve_peer", "serve_rounds", "serving_threads"]


def serving_threads(server: Any) -> list[threading.Thread]:
    """The threads that serve `server`'s peers (and coordinator), not started."""
    if server.mode.serves_in_rounds:
        threads = [threading.Thread(target=serve_rounds, args=(server,), daemon=True, name="peers")]
    else:
        threads = [
            threading.Thread(
                target=serve_peer,
                args=(server, server.link(r, w)),
                daemon=True,
                name=f"peer-{r}-{w}",
            )
            for r in range(server.replicas)
            for w in server.workers
        ]
    if server.mode.commands:
        threads.append(
            threading.Thread(target=_commands, args=(server,), daemon=True, name="commands")
        )
    return threads


def _failing(loop):
    """A serving loop whose unexpected error fails the shard in one line (not a silent
    thread death the shard would wait on for ever)."""

    @functools.wraps(loop)
    def run(server: Any, *args) -> None:
        try:
            loop(server, *args)
        except Exception as exc:
            server.fail(f"{loop.__name__} failed: {type(exc).__name__}: {exc}")
            raise

    return run


@_failing
def serve_peer(server: Any, link: Any) -> None:
    """Serve one peer from its own thread until it says goodbye or is lost. The receive of
    the peer's next request is posted before this one is answered: gloo sends a message only
    once its receive is posted, and the notice that it is travels behind whatever the link
    carries that way, the answer included; posted first, the peer's next push (a Downpour
    worker's, sent while the answer comes) crosses the link beside the answer."""
    try:
        request = server.group.recv([link.request], link.src, TAG_HEADER)
        while True:
            request.wait()
            kind, step, extra = server.take(link)  # done with link.request
            if kind != Kind.BYE:
                request = server.group.recv([link.request], link.src, TAG_HEADER)
            if server.answer(link, kind, step, extra):
                return
    except (RuntimeError, ProtocolError) as exc:
        server.drop(link, exc)


@_failing
def serve_rounds(server: Any) -> None:
    """Serve every peer from one thread, a round at a time (sync): receive one request from
    each peer not waiting for an answer, then answer every waiting peer whose step is
    applied. Each sends one request per step and waits for its answer, so once a round is
    in, the step is complete, and no hand-off between threads lies between the last push and
    the replies. Peers that wait for a step no peer left can complete fail the shard in one
    line instead of waiting for ever."""
    links = [server.link(r, w) for r in range(server.replicas) for w in server.workers]
    waiting: list[tuple] = []  # (link, kind, step, extra) taken, not yet answered

    def drop(link, exc) -> None:
        server.drop(link, exc)
        if link in links:
            links.remove(link)

    while links:
        busy = {item[0] for item in waiting}
        posted = []
        for link in [x for x in links if x not in busy]:
            try:
                posted.append((link, server.group.recv([link.request], link.src, TAG_HEADER)))
            except RuntimeError as exc:
                drop(link, exc)
        for link, work in posted:
            try:
                work.wait()
                waiting.append((link, *server.take(link)))
            except (RuntimeError, ProtocolError) as exc:
                drop(link, exc)
        waiting = _answer_ready(server, waiting, links, drop)
        if waiting and len(waiting) == len(links):
            link, _, step, _ = waiting[0]
            server.fail(
                f"replica {link.replica} waits for step {step}, which no peer left can complete"
            )
            return


def _answer_ready(server: Any, waiting: list, links: list, drop) -> list:
    """Answer the waiting (link, kind, step, extra) whose answer is ready, again while one
    more became ready (a goodbye can make another's step answerable); those left."""
    while True:
        left = []
        for item in waiting:
            link, kind, step, _ = item
            if not server.ready(link, kind, step):
                left.append(item)
                continue
            try:
                if server.answer(*item):
                    links.remove(link)
            except (RuntimeError, ProtocolError) as exc:
                drop(link, exc)
        if len(left) == len(waiting):
            return left
        waiting = left


def _commands(server: Any) -> None:
    """Sandblaster: serve the coordinator's operations until it stops (or is gone)."""
    try:
        serve_commands(
            server.group, server.setup.coordinator, server.rank, server.shard, server.command
        )
    finally:
        server.end_commands()
