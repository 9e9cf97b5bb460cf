//! The tokenizer actor: a small pool of sync workers that turn prompts into token ids,
//! chat messages included (the template rendered and encoded in one call).

use crate::error::{EngineError, Result};
use crate::request::Prompt;
use actix::prelude::*;
use quantmesh_model::TextTokenizer;
use std::sync::Arc;

/// Engine handle → tokenizer: a prompt (text, chat messages, or ids) to token ids; chat
/// messages are rendered with the model's template and encoded in the same call.
#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, EngineError>")]
pub struct EncodePrompt(pub Prompt);

pub struct TokenizerActor {
    pub tokenizer: Arc<TextTokenizer>,
}

impl Actor for TokenizerActor {
    type Context = SyncContext<Self>;
}

impl Handler<EncodePrompt> for TokenizerActor {
    type Result = Result<Vec<u32>>;
    fn handle(&mut self, msg: EncodePrompt, _: &mut Self::Context) -> Self::Result {
        let tok = &self.tokenizer;
        Ok(match msg.0 {
            Prompt::Text { text, add_bos } => tok.encode(&text, add_bos)?,
            // The rendered template carries its own BOS where the model wants one.
            Prompt::Chat(messages) => tok.encode(&tok.apply_chat_template(&messages)?, false)?,
            Prompt::Tokens(ids) => ids,
        })
    }
}
