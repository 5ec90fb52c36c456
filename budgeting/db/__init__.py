"""Below every room: the hot path's cursor and the database clock (``cursor``), and rows' statements as
Django's compiler writes them (``rows``). Imports Django and psycopg only, never a room."""
