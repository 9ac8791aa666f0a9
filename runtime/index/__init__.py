"""An index on a device: a snapshot's arrays where the search reads them (served), pinned on their
way there (staging), loaded complete in one go (loader), and swapped for newer ones (watcher)."""
