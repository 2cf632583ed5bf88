"""The Responses API and the Anthropic Messages API as translations onto the chat path: a body is turned
into a chat request (``responses_api``, ``messages_api``), run by the OpenAI service (``bridged``), and its
result or chunk stream turned back (``responses_stream``, ``messages_stream``); ``chat_bridge`` holds what
both share. Imports ``openai/`` only."""
