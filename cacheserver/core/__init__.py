"""The request core: every verb admitted, named and carried out once, for every transport."""
