"""`jaxinfer chat`: an interactive streaming chat in the terminal, with the engine in process or
against a server (--url)."""
