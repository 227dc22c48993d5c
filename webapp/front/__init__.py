"""The browser-facing pages: home dashboard (more pages join as the product grows)."""
