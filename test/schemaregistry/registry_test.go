package schemaregistry

import (
	"os"
	"path/filepath"
	"testing"
)

// TestJavaVersion reads a JDK's feature version from the release file of
// its home, through the links Debian puts on PATH.
func TestJavaVersion(t *testing.T) {
	dir := t.TempDir()
	for home, release := range map[string]string{"jdk-17": `JAVA_VERSION="17.0.15"`, "jdk-25": "IMPLEMENTOR=\"x\"\nJAVA_VERSION=\"25.0.3\"\n"} {
		if err := os.MkdirAll(filepath.Join(dir, home, "bin"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, home, "bin", "java"), nil, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, home, "release"), []byte(release), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(dir, "java")
	if err := os.Symlink(filepath.Join(dir, "jdk-25", "bin", "java"), link); err != nil {
		t.Fatal(err)
	}
	for java, want := range map[string]int{
		filepath.Join(dir, "jdk-17", "bin", "java"): 17,
		link: 25,
		filepath.Join(dir, "none", "bin", "java"): 0,
	} {
		if got := javaVersion(java); got != want {
			t.Errorf("javaVersion(%s) = %d; want %d", java, got, want)
		}
	}
}
