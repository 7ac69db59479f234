"""The join token of a lab's HTTPS line: where its hub is, how to trust it, what proves a site may join.

``LineToken.encode()`` is the text after ``python -m labkit join``; ``decode`` reads it back and
says in words what is wrong with a mangled one. The token holds:

- ``url``: the hub's ``wss://host:port/labkit/line``, as the joining machine dials it;
- ``lab``: this lab's id (a token of another lab, or of this lab's earlier run, is refused);
- ``secret``: the key both ends prove they hold (HMAC of a fresh nonce; it never crosses the line);
- ``pin``: the SHA-256 of the hub's certificate when the lab made its own certificate, None when
  the hub has one a certificate authority signed (then the joining machine checks it as any HTTPS
  client does, against its trust store or ``--cafile``);
- ``expires``: after this (Unix time) the hub admits no *new* site with it; sites that joined keep
  their line, reconnects included.

Whoever holds a token until it expires can run code in the lab: share it like a password.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass

from labkit.spec.errors import LabConfigError

PREFIX = "lkline1."  # tells the join command that this is an HTTPS line's token, not a controller's
PATH = "/labkit/line"


@dataclass(frozen=True)
class LineToken:
    url: str
    lab: str
    secret: str  # hex
    expires: float
    pin: str | None = None  # hex SHA-256 of the hub's certificate (DER), when the lab made it

    def encode(self) -> str:
        text = json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)
        return PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @property
    def expired(self) -> bool:
        return time.time() > self.expires

    def proof(self, nonce: str, who: str) -> str:
        """What ``who`` ("site" or "hub") answers to ``nonce``: only a holder of the secret can say it."""
        return prove(self.secret, nonce, who)


def prove(secret: str, nonce: str, who: str) -> str:
    return hmac.new(bytes.fromhex(secret), f"{who}:{nonce}".encode(), hashlib.sha256).hexdigest()


def proof_holds(secret: str, nonce: str, who: str, proof: object) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(prove(secret, nonce, who), proof)


def is_line_token(text: str) -> bool:
    return text.strip().startswith(PREFIX)


def decode(text: str) -> LineToken:
    """The token in ``text``, or a LabConfigError that says to copy the whole line again."""
    body = text.strip().removeprefix(PREFIX)
    try:
        fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        token = LineToken(url=fields["url"], lab=fields["lab"], secret=fields["secret"],
                          expires=float(fields["expires"]), pin=fields.get("pin"))
        bytes.fromhex(token.secret)
        if not all(isinstance(value, str) for value in (token.url, token.lab)):
            raise TypeError("the url and the lab are text")
    except (ValueError, KeyError, TypeError, UnicodeError, binascii.Error):
        raise LabConfigError("this is not a whole join token of a lab's HTTPS line: copy the whole command that "
                             "%lab join-command --https (lab.join_command(https=True)) printed") from None
    if not token.url.startswith("wss://"):
        raise LabConfigError(f"the join token names {token.url!r}, not an HTTPS (wss://) address: print a new one")
    return token
