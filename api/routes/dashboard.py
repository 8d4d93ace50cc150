"""``/``: the dashboard, a static page that polls the API (plain HTML and JavaScript).

The page itself holds no data, so it is served without a token; the API calls it makes carry the
token the user enters in the page.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)


@router.get("/")
def dashboard() -> FileResponse:
    """The dashboard page."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})
