package bench

import "testing"

func TestParseFloorVariant(t *testing.T) {
	for in, want := range map[string]floorVariant{
		"1":    {producers: 1},
		"2s":   {producers: 2, settle: true},
		"1sc":  {producers: 1, settle: true, checkpoint: true},
		"2c":   {producers: 2, checkpoint: true},
		"1scp": {producers: 1, settle: true, checkpoint: true, pgLoad: true},
	} {
		got, err := parseFloorVariant(in)
		if err != nil || got != want {
			t.Errorf("parseFloorVariant(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "3", "1x", "s"} {
		if _, err := parseFloorVariant(in); err == nil {
			t.Errorf("parseFloorVariant(%q) accepted", in)
		}
	}
	if err := CheckFloorVariants([]string{"1s", "2q"}); err == nil {
		t.Error("CheckFloorVariants accepted 2q")
	}
}
