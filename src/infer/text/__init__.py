"""Text in and out of a model, without torch: chat templates in a bounded sandbox (`chat_template`),
a chat's history (`chat_history`), how text and a chat with tools become a prompt (`prompts`), each
family's tool-call format (`tools`), a generation's text decoded as it grows with its stop strings
(`stream`), and the constraints and logits processing of a request
(`structured`). Nothing is imported here: each module is imported by its own name."""
