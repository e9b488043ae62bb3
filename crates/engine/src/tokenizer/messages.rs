//! A chat's turns as templates read them.

use serde::Serialize;

/// One turn as chat templates see it. Assistant turns may carry tool calls; `tool` turns
/// carry a tool's output (and the id of the call it answers).
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Where images sit in `content` (byte offsets, in order): each renders as the model's
    /// image markup there (`Tokenizer::set_image_tokens`).
    #[serde(skip)]
    pub images: Vec<usize>,
}

/// A function call, shaped as Qwen's templates read it
/// (`{"type": "function", "function": {"name", "arguments"}}`, arguments as JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

impl ToolCall {
    pub fn new(name: &str, arguments: serde_json::Value) -> Self {
        ToolCall { kind: "function", function: FunctionCall { name: name.into(), arguments } }
    }
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: vec![],
            tool_call_id: None,
            images: vec![],
        }
    }
}
