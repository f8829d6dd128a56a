"""Write one JSON Schema file per event type into schemas/json/: the current version.

`python -m schemas.generate` regenerates; tests/unit/test_schemas.py fails when
a committed file is stale. The previous version's schemas and example payloads
(schemas/json/v<N-1>/, docs/schemas.md) are data, frozen when that version was
replaced: never written here, since the models now describe the current version.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.events import EVENT_TYPES
from schemas.upgrade import PREVIOUS_VERSION

OUT_DIR = Path(__file__).parent / "json"
PREVIOUS_DIR = OUT_DIR / f"v{PREVIOUS_VERSION}"


def render() -> dict[str, str]:
    files = {}
    for event_type in EVENT_TYPES:
        schema = event_type.model_json_schema()
        schema["$id"] = f"https://trainmedic.dev/schemas/{event_type.type_name}.schema.json"
        files[f"{event_type.type_name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def main() -> None:
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT_DIR / name).write_text(text)
        print(f"wrote schemas/json/{name}")


if __name__ == "__main__":
    main()
