"""`kvshare audit`: an operator's checks of isolation against a live deployment."""
