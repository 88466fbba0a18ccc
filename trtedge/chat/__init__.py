"""`trtedge chat`: conversation state and commands (session), answer sources (backends), terminal (tui)."""
