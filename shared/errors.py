"""genq's error tree. Raised as values inside the services; translated to HTTP in one place.

GenqError
├── BadRequest            400  invalid input the schema could not catch
│   └── PromptTooLong     400  prompt + max_tokens over the model's limit
├── Unauthorized          401
├── NotFound              404
│   ├── JobNotFound
│   └── ModelNotFound
├── Conflict              409  e.g. cancelling a finished job
├── TooLarge              413  an upload over a size or line limit
├── Unprocessable         422  e.g. an idempotency key reused with another body
├── TooManyRequests       429
└── Unavailable           503  Redis unreachable, no worker for the model
"""

from __future__ import annotations


class GenqError(Exception):
    status = 500
    code = "internal_error"
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
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


class Conflict(GenqError):
    status = 409
    code = "conflict"
    type = "invalid_request_error"


class TooLarge(GenqError):
    status = 413
    code = "too_large"
    type = "invalid_request_error"


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
