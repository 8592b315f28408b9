"""mtpchat's Qt desktop app (later issue)."""
