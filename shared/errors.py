"""genq's error tree. Raised as values inside the services; translated to HTTP in one place.

GenqError
├── BadRequest            400  invalid input the schema could not catch
│   └── PromptTooLong     400  prompt + max_tokens over the model's limit
├── Unauthorized          401
├── NotFound              404
│   ├── JobNotFound
│   └── ModelNotFound
├── MethodNotAllowed      405
├── Conflict              409  e.g. cancelling a finished job
├── PayloadTooLarge       413  a request body over GENQ_MAX_BODY_BYTES
│   └── TooLarge          413  an upload over a size or line limit
├── Unprocessable         422  e.g. an idempotency key reused with another body
├── TooManyRequests       429  a queue limit, a key's quota or request rate
└── Unavailable           503  Redis unreachable or nearly full, no worker for the model

`retry_after_s` (429, 503) becomes the `Retry-After` header.
"""

from __future__ import annotations

SHOWN_CHARS = 64
"""Most characters of a client's value (a model name, an id) an error message echoes."""


def escaped(value: str, limit: int = SHOWN_CHARS) -> str:
    """`value` fit to echo in an error message: control and non-printable characters (and lone
    surrogates) escaped, cut to `limit` characters with an ellipsis."""
    text = repr(value[:limit])[1:-1]
    return text + "…" if len(value) > limit else text


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """`value` escaped and cut (see `escaped`), in quotes: `model 'x'`."""
    return f"'{escaped(value, limit)}'"


class GenqError(Exception):
    status = 500
    code = "internal_error"
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        if code is not None:
            self.code = code


class BadRequest(GenqError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class PromptTooLong(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(GenqError):
    status = 401
    code = "invalid_api_key"
    type = "authentication_error"


class NotFound(GenqError):
    status = 404
    code = "not_found"
    type = "not_found_error"


class JobNotFound(NotFound):
    code = "job_not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GenqError):
    status = 405
    code = "method_not_allowed"
    type = "invalid_request_error"


class Conflict(GenqError):
    status = 409
    code = "conflict"
    type = "invalid_request_error"


class PayloadTooLarge(GenqError):
    status = 413
    code = "payload_too_large"
    type = "invalid_request_error"


class TooLarge(PayloadTooLarge):
    code = "too_large"


class Unprocessable(GenqError):
    status = 422
    code = "unprocessable"
    type = "invalid_request_error"


class TooManyRequests(GenqError):
    status = 429
    code = "rate_limited"
    type = "rate_limit_error"


class Unavailable(GenqError):
    status = 503
    code = "unavailable"
    type = "server_error"
