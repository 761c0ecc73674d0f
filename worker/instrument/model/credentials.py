"""Provider credentials: where a key is looked up, and the rule that it goes nowhere else.

Owns the lookup of one secret by the name of its variable, in this order: the
environment variable itself, the file named by ``<VAR>_FILE`` (Docker and Compose
secrets), then ``$CREDENTIALS_DIRECTORY/<VAR>`` (systemd ``LoadCredential=``).
A key is read at the moment of use and handed straight to the HTTP request that
needs it; nothing here keeps, logs or echoes it, and every message names only the
variable. Trusts: the worker's own environment and the files it names.
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.instrument.errors import Refusal


class Credential:
    """The name of a secret and where to find it; never the secret itself.

    Holding only the name means no repr, pickle or settings dump of a provider can
    carry the key, and a rotated secret file is picked up by the next call.
    """

    def __init__(self, variable: str) -> None:
        self.variable = variable

    def __repr__(self) -> str:
        return f"Credential({self.variable!r})"

    def read(self) -> str | None:
        """The secret, or None when none of its three sources is set.

        Raises Refusal when a source is set but unusable (unreadable file, blank, or
        anything but printable ASCII inside): such a key cannot go into a request
        header, and http.client would quote it in its error message.
        """
        value, source = self._lookup()
        if value is None:
            return None
        secret = value.strip()
        if not secret or not all("!" <= ch <= "~" for ch in secret):
            raise Refusal(
                f"{source} is set but does not hold a usable key "
                "(empty, or a character other than printable ASCII inside)"
            )
        return secret

    def require(self) -> str:
        """The secret, or a Refusal naming the variable and the ways to provide it."""
        secret = self.read()
        if secret is None:
            raise Refusal(
                f"{self.variable} is not set: export it, name a file holding it in "
                f"{self.variable}_FILE, or provide it as a systemd credential named "
                f"{self.variable}"
            )
        return secret

    def _lookup(self) -> tuple[str | None, str]:
        direct = os.environ.get(self.variable)
        if direct:
            return direct, self.variable
        file_variable = f"{self.variable}_FILE"
        named = os.environ.get(file_variable)
        if named:
            return _read_secret_file(Path(named), file_variable), file_variable
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if directory:
            candidate = Path(directory) / self.variable
            if candidate.is_file():
                source = f"$CREDENTIALS_DIRECTORY/{self.variable}"
                return _read_secret_file(candidate, source), source
        return None, self.variable


def _read_secret_file(path: Path, source: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        # The path is configuration, not secret; the content never appears.
        raise Refusal(
            f"{source} names {path}, which cannot be read: {type(exc).__name__}"
        ) from None
