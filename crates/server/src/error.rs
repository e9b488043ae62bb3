//! Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::job::JobError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    /// The prompt did not fit the context: each protocol says so in its own convention
    /// (OpenAI's `context_length_exceeded` code, Anthropic's `prompt is too long: N tokens > M
    /// maximum`), which clients read to compact the conversation instead of giving up.
    pub overflow: Option<Overflow>,
}

/// A prompt of `prompt_tokens` (at least) that a context of `context` cannot hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    pub prompt_tokens: usize,
    pub context: usize,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, overflow: None }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    /// The request is fine but the server's state forbids it now (a model in use, a download
    /// running).
    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::CONFLICT, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_exceeded",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::BadRequest(m) => ApiError::bad_request(m),
            JobError::Busy(m) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, m),
            JobError::Internal(m) => ApiError::internal(m),
            JobError::Unavailable(m) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m),
            JobError::TooLong { message, prompt_tokens, context } => ApiError {
                overflow: Some(Overflow { prompt_tokens, context }),
                ..ApiError::bad_request(message).with_param("messages")
            },
        }
    }
}

/// Says in the log why a request was refused (the line after it gives the route and status).
/// Debug-quoted: the message may echo what the client sent.
fn log_refusal(status: StatusCode, message: &str) {
    if status.is_server_error() {
        tracing::warn!("answered {status}: {message:?}");
    } else {
        tracing::info!("refused ({status}): {message:?}");
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        log_refusal(self.status, &self.message);
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.overflow.map(|_| "context_length_exceeded"),
            }
        });
        with_retry_after(self.status, (self.status, Json(body)).into_response())
    }
}

/// A 429 (the queue is full) says when to come back.
fn with_retry_after(status: StatusCode, mut response: Response) -> Response {
    if status == StatusCode::TOO_MANY_REQUESTS {
        response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
    }
    response
}

/// Parses a JSON body, naming the field that is wrong.
pub fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::bad_request(format!("the body is not valid JSON: {inner}"))
        } else {
            ApiError::bad_request(format!("`{path}`: {inner}")).with_param(&path)
        }
    })
}

/// The same error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl From<JobError> for AnthropicError {
    fn from(e: JobError) -> Self {
        AnthropicError(e.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let e = self.0;
        let kind = match e.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        };
        // Anthropic's own wording, which Claude Code matches to compact the conversation.
        let message = match e.overflow {
            Some(o) => format!("prompt is too long: {} tokens > {} maximum", o.prompt_tokens, o.context),
            None => e.message,
        };
        log_refusal(e.status, &message);
        let body = Json(serde_json::json!({"type": "error", "error": {"type": kind, "message": message}}));
        with_retry_after(e.status, (e.status, body).into_response())
    }
}
