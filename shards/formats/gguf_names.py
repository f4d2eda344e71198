"""What names a GGUF file's failures and its split parts, without the `gguf` package.

Apart from `gguf_file` because the format-independent paths (the loader, the fetch layout, a block's config) catch
`GGUFError` and match split names for every model, while the `gguf` package (and the yaml it imports) is worth
loading only when the model is a GGUF file.
"""

from __future__ import annotations

import re


class GGUFError(ValueError):
    """A GGUF file is unreadable, corrupt, or describes something exo-node cannot run. Names the file."""


SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
