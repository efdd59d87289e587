"""What a reply may be: tool calls (a template's own syntax or kvmem's generic format),
response formats as grammars, and the constrained decoding that enforces them."""
