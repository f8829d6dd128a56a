"""Write one JSON Schema file per event type into schemas/json/.

`python -m schemas.generate` regenerates; tests/unit/test_schemas.py fails when
a committed file is stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.events import EVENT_TYPES

OUT_DIR = Path(__file__).parent / "json"


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
