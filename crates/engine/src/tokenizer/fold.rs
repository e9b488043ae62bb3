//! System turns moved to where a template takes them.

use super::messages::ChatMessage;

/// The same conversation with system turns only at its start, for templates that take no
/// other: the leading system turns joined into one, and each later one put before the next
/// user turn's text (or, with no user turn right after it, as a user turn of its own).
pub fn fold_system_turns(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let leading = messages.iter().take_while(|m| m.role == "system").count();
    let mut out = Vec::with_capacity(messages.len());
    if leading > 0 {
        let text: Vec<&str> = messages[..leading].iter().map(|m| m.content.as_str()).collect();
        out.push(ChatMessage::new("system", &text.join("\n\n")));
    }
    let mut pending: Vec<&str> = Vec::new();
    for m in &messages[leading..] {
        if m.role == "system" {
            pending.push(&m.content);
            continue;
        }
        if !pending.is_empty() {
            let system = pending.join("\n\n");
            pending.clear();
            if m.role == "user" {
                let mut turn = m.clone();
                turn.content = format!("{system}\n\n{}", m.content);
                // Its images stay where they were in its own text.
                turn.images = m.images.iter().map(|at| at + system.len() + 2).collect();
                out.push(turn);
                continue;
            }
            out.push(ChatMessage::new("user", &system));
        }
        out.push(m.clone());
    }
    if !pending.is_empty() {
        out.push(ChatMessage::new("user", &pending.join("\n\n")));
    }
    out
}
