"""Credentials in tracking URIs, without MLflow (params validate with this alone, before
the flow loads Prefect, MLflow and torch): how to spot one, how to keep it out of what a
run stores and shows, and how to hand a server's to MLflow through the environment."""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import unquote

# A credential in a URI: its user info, all between '://' and the last '@' of a URI with an
# authority (any character: people type '/', '#', '@' and spaces in passwords unescaped), or
# a password in its query (SQLAlchemy hands it to the database's driver).
_PASSWORD_KEY = "".join(f"[{c.upper()}{c}]" for c in "password")  # no flags in a JSON schema
CREDENTIAL = rf"://[^/][\s\S]*@|[?&]{_PASSWORD_KEY}="
CREDENTIAL_ADVICE = (
    "holds a credential, which params never do (Prefect stores and shows a run's "
    "parameters): give it in the environment, MLFLOW_TRACKING_USERNAME and "
    "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for a tracking server, or the whole "
    "URI in MLFLOW_TRACKING_URI"
)
# In free text (a library's message): a URL's user info up to its last '@' within the word.
_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)(?=[^/\s])\S*@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(rf"([?&]{_PASSWORD_KEY}=)[^&\s]*")
_secrets: set[str] = set()  # the credentials of URIs this process was given: never shown


def holds_credential(text: str) -> bool:
    return re.search(CREDENTIAL, text) is not None


def redact(text: str) -> str:
    """`text` with every credential this process knows of, and the user info and query
    password of every URL in it, as ***."""
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def _split_userinfo(uri: str) -> tuple[str, str | None, str]:
    """(scheme://, user info or None, the rest) of a URI, user info up to its last '@'."""
    scheme, sep, rest = uri.partition("://")
    if not sep or rest.startswith("/") or "@" not in rest:
        return uri, None, ""
    userinfo, host = rest.rsplit("@", 1)
    return scheme + sep, userinfo, host


class Redacting(logging.Filter):
    """Log records with their URLs' credentials redacted: MLflow, requests and Prefect
    write the URIs they were given into their messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        return True


def redact_logs() -> None:
    """Every log handler of this process (Prefect's console and API ones included) drops
    URL credentials from what it writes."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    for handler in handlers:
        if not any(isinstance(f, Redacting) for f in handler.filters):
            handler.addFilter(Redacting())


def credentials_to_env(uri: str) -> str:
    """The environment's tracking URI (MLFLOW_TRACKING_URI; params hold none with a
    credential, tasks/settings.py) with a server's user info moved to the environment
    MLflow reads it from (MLFLOW_TRACKING_USERNAME/PASSWORD, or MLFLOW_TRACKING_TOKEN for a
    token alone), inherited by the ranks. A database's URI keeps its credential (its driver
    needs it). Either way redact() knows the credential from here on."""
    scheme, userinfo, host = _split_userinfo(uri)
    query = _QUERY_PASSWORD.search(uri)
    if query and query.end() - query.end(1) >= 4:
        _secrets.add(uri[query.end(1) : query.end()])
    if userinfo is None:
        return uri
    user, _, password = userinfo.partition(":")
    # (not the user name alone: a short one would star out every word that holds it)
    _secrets.update(s for s in (userinfo, unquote(userinfo), password, unquote(password))
                    if len(s) >= 4)  # fmt: skip
    if scheme not in ("http://", "https://"):
        return uri
    if password:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    else:
        os.environ["MLFLOW_TRACKING_TOKEN"] = unquote(user)
    return scheme + host
