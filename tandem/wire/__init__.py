"""The bytes on the wire: a dtype code table (`dtypes`) and a versioned frame (`frame`). No torch."""
