"""One module per experiment; each public function draws one paper figure from a run's rows."""
