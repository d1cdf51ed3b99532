"""What reading JSON text a client or a model wrote may raise (a module of its own: the parsers of model output are
imported before the server's checks can be)."""

# Python's JSON parser raises, beside ``JSONDecodeError`` (a ``ValueError``) for text that is no JSON, a ``ValueError``
# of its own for a number of more digits than ``int`` takes (4,300) and a ``RecursionError`` for nesting deeper than
# the interpreter's stack. Unread, either was a 500, or a stream cut short.
UNREADABLE_JSON = (ValueError, RecursionError)
