"""The per-upstream view shared by every backend kind: the adapter.

An adapter holds what the proxy knows of one upstream now: its current dialect (how
requests are written for it: dialects/, a frozen value replaced whole when probing learns
something that changes it), its slot count, whether its stops can be confirmed
(``can_confirm``) and how (``confirm_stopped``, ``watch_idle``), what its slots are doing
(``busy_map``), and what is still to learn (``pending``, ``refresh``). Cancelling is always
"close the upstream connection" and is done by the job (job.py), not here.

An adapter holds the two ways to its backend: ``client`` (client.py), which every
relayed request goes through, and the app's ``session``, for its own probes and polls.
The app's cleanup closes ``client`` (``close``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, NotRequired, TypedDict

import aiohttp
import structlog
from aiohttp import encode_basic_auth
from yarl import URL

from llmproxy.common.redact import strip_userinfo, userinfo
from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.request import Body
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.upstream.client import UpstreamClient
from llmproxy.proxy.upstream.dialects.base import Dialect, TooManySlots

log = structlog.get_logger("llmproxy.adapter")


PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def get_json(session: aiohttp.ClientSession, url: str | URL) -> tuple[int, Any]:
    """One probe or poll with the app's session: (status, the body as JSON or None)."""
    async with session.get(url, timeout=PROBE_TIMEOUT, allow_redirects=False) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, None


def upstream_authorization(settings: ProxySettings) -> str | None:
    """The ``Authorization`` value for every request to the upstream (relayed requests and
    the proxy's own probes): the upstream's API key, else Basic from the credentials in its
    URL (``http://user:pass@host``), else None. The URL is used without its credentials
    everywhere else (``Adapter.base_url``), so they are never shown."""
    key = settings.upstream_api_key
    if key is not None:
        return f"Bearer {key.get_secret_value()}"
    creds = (
        userinfo(settings.upstream) if settings.upstream and "," not in settings.upstream else None
    )
    return None if creds is None else encode_basic_auth(*creds)


class AdapterInfo(TypedDict):
    """What ``Adapter.describe`` tells (the status page, the start-up log line)."""

    kind: str
    url: str
    slots: int | None
    can_confirm: bool
    detected: bool
    model: NotRequired[str]  # a router's model (router.py) ...
    model_status: NotRequired[str]  # ... and whether the router runs it


#: what one look at the upstream's slots found: slot id -> busy; or "down" (nothing can
#: run: a refused connection) or "unknown" (no view, or a look that says nothing)
BusyMap = dict[int, bool] | Literal["down", "unknown"]


class Adapter:
    kind: ClassVar[str] = "openai"
    #: slot i of the gate is slot i at the upstream, which lists them (``busy_map``): the
    #: slots of a request on several of them are settled before it is sent (settle.py)
    lists_slots: ClassVar[bool] = False

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        settings: ProxySettings,
        *,
        slots: int | None = None,
    ) -> None:
        self.base_url = URL(strip_userinfo(base_url).rstrip("/"))  # credentials: a header
        self.session = session
        self.client = UpstreamClient(
            self.base_url,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            authorization=upstream_authorization(settings),
        )
        self.settings = settings
        self.dialect = self.initial_dialect()  # replaced whole, never changed in place
        self.slots = slots
        self.can_confirm = False
        self.known = asyncio.Event()  # set once nothing is left to learn (``pending``; watch.py)
        # kind auto, upstream not there at start (no answer, 502-504): detected again
        self.undetected = False
        self.piece_gap_s: float | None = None  # recent streams' gap between pieces (about a token)
        #: the model ids its ``/v1/models`` reported at detection (detect.py; empty: none)
        self.models: tuple[str, ...] = ()

    def probe_url(self, name: str) -> URL:
        """The URL of the upstream's own ``name`` endpoint (``slots``, ``props``) for the
        proxy's probes; a router's model asks with its name (router.py)."""
        return self.base_url / name

    async def learn_models(self) -> None:
        """Read the model ids ``GET /v1/models`` lists (OpenAI's shape, which llama-server,
        vLLM, llama-cpp-python and Ollama answer) into ``models``; left as they are when it
        does not answer that way."""
        try:
            status, body = await get_json(self.session, self.base_url / "v1" / "models")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return
        data = body.get("data") if status == 200 and isinstance(body, dict) else None
        if isinstance(data, list):
            ids = [d.get("id") for d in data if isinstance(d, dict)]
            self.models = tuple(dict.fromkeys(i for i in ids if isinstance(i, str) and i))

    def initial_dialect(self) -> Dialect:
        """The dialect before anything is probed."""
        return Dialect(kind=self.kind)

    def permits(self, path: str, body: Body, capacity: int) -> int:
        """How many slots (1..``capacity``) a gated request on ``path`` occupies at once
        (the dialect's count), or ``BadRequest`` if it cannot fit, saying why."""
        try:
            return self.dialect.permits(path, body, capacity)
        except TooManySlots as exc:
            raise BadRequest(f"{exc}: {self.short_of_slots(capacity)}") from None

    def short_of_slots(self, capacity: int) -> str:
        """Why a request asking for more slots than ``capacity`` cannot have them."""
        return "the upstream has no more"

    def note_piece_gap(self, gap: float) -> None:
        """A finished stream's mean gap between pieces: the adapter's estimate of a token's
        time follows it (an average weighted to the recent ones)."""
        self.piece_gap_s = gap if self.piece_gap_s is None else 0.8 * self.piece_gap_s + 0.2 * gap

    def cold(self) -> bool:
        """Will the upstream load its model before it answers (router.py: a router's model
        it does not run now)? A request granted then waits for the load."""
        return False

    def pending(self) -> bool:
        """Is something about the upstream still to be learnt by probing again (see watch.py)?"""
        return self.undetected

    def capacity_pending(self) -> bool:
        """Is what sizes the gate (kind, slot count) still to be learnt (see watch.py)?"""
        return self.undetected

    async def refresh(self) -> None:
        """Probe again for what ``pending`` says is still missing."""

    def confirms(self, path: str) -> bool:
        """Can a stopped request on ``path`` be confirmed (``confirm_stopped``) on this backend?"""
        return self.can_confirm

    async def busy_map(self) -> BusyMap:
        """One look at what the upstream's slots are doing (adapters/slots.py); an adapter
        without a view knows nothing."""
        return "unknown"

    async def confirm_stopped(self, slots: Sequence[int], *, answered: bool = True) -> bool:
        """Wait until the backend shows every slot in ``slots`` idle. Adapters without a view
        return True.

        ``answered``: the upstream had sent response headers, so its task had surely started."""
        return True

    async def watch_idle(
        self,
        slots: Sequence[int],
        idle: Callable[[int], None],
        closing: asyncio.Event,
        *,
        answered: bool = True,
    ) -> None:
        """After ``confirm_stopped`` gave up: call ``idle(slot)`` for each of ``slots`` once the
        backend shows it idle, and return when none is left, or once ``closing`` is set
        (shutdown). Adapters without a view have nothing to watch: all idle at once."""
        for slot in slots:
            idle(slot)

    def close(self) -> None:
        """Close the relay client's idle connections (app cleanup)."""
        self.client.close()

    def describe(self) -> AdapterInfo:
        return {
            "kind": self.kind,
            "url": str(self.base_url),
            "slots": self.slots,
            "can_confirm": self.can_confirm,
            "detected": not self.undetected,
        }
